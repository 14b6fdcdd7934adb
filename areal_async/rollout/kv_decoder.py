"""The forward passes behind ``TorchEngine``: a preallocated KV cache and two decoders that fill it.

``KVCache`` holds a cohort's keys and values in one buffer per kind, (layers, B, kv heads,
capacity, head dim), filled left to right: columns ``[0, T)`` hold tokens, later columns are
room for the tokens still to be decoded. A decode step writes one column in place; nothing
grows or is concatenated per step.

A decoder runs ``forward(ids_BT, pos_BT, mask_BK, cache, logits)``: the new tokens ``ids_BT`` at
positions ``pos_BT`` attend to the cache's ``T`` columns and to each other (causally), masked by
``mask_BK`` (K = T + the new tokens; 0 = left padding); their keys/values are written at
``[T, K)``; it returns the logits of the last position (B, V) when ``logits`` is true.

- ``LeanLlama``: Llama and Qwen2 (full attention, no sliding window) computed from the HF
  model's own modules (embedding, norms, projections, MLP, rotary embedding, lm head), so
  weights loaded into the HF model are used as they are; attention reads the cache buffer
  (``scaled_dot_product_attention``, or matmuls for one query on CPU). No HF cache object, no
  mask construction, no per-step output containers.
- ``HFDecoder``: any other causal LM through its own ``forward`` and a ``DynamicCache`` built on
  the filled columns (the fallback; slower, same results).

Not covered: sliding-window or hybrid attention in the lean path, paged memory, tensor parallelism.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

LEAN_MODEL_TYPES = ("llama", "qwen2")


class KVCache:
    """Keys/values ``k``, ``v`` (L, B, H, C, D); columns ``[0, T)`` are filled, ``[T, C)`` are room."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, T: int):
        assert k.shape == v.shape and 0 <= T <= k.shape[3], (tuple(k.shape), tuple(v.shape), T)
        self.k, self.v, self.T = k, v, T

    @classmethod
    def empty(cls, model: PreTrainedModel, B: int, capacity: int) -> "KVCache":
        cfg = model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        shape = (cfg.num_hidden_layers, B, cfg.num_key_value_heads, capacity, D)
        # uninitialised: a column is written before anything reads it (reads stop at T)
        k, v = (torch.empty(shape, dtype=p.dtype, device=p.device) for _ in "kv")
        return cls(k, v, 0)

    @property
    def room(self) -> int:
        return self.k.shape[3] - self.T

    def select(self, idx_B: torch.Tensor, start: int) -> "KVCache":
        """Rows ``idx_B`` (in that order), columns from ``start`` on (a copy)."""
        k, v = (x.index_select(1, idx_B)[:, :, :, start:] for x in (self.k, self.v))
        return KVCache(k, v, self.T - start)

    def repeat_rows(self, rows_B: torch.Tensor) -> "KVCache":
        """Row ``rows_B[i]`` of this cache as row i (a group's prompt cache for each of its samples)."""
        return KVCache(self.k.index_select(1, rows_B), self.v.index_select(1, rows_B), self.T)

    def merge(self, other: "KVCache") -> "KVCache":
        """Rows of ``self`` then of ``other``, the shorter one left-padded with zeros (masked columns)."""
        T, room = max(self.T, other.T), max(self.room, other.room)
        return KVCache(*(torch.cat([self._padded(kind, T, room), other._padded(kind, T, room)], 1) for kind in "kv"), T)

    def _padded(self, kind: str, T: int, room: int) -> torch.Tensor:
        x = getattr(self, kind)
        L, B, H, _, D = x.shape
        out = x.new_zeros(L, B, H, T + room, D)
        out[:, :, :, T - self.T : T] = x[:, :, :, : self.T]
        return out


def make_decoder(model: PreTrainedModel, lean: bool = True):
    """``LeanLlama`` when ``lean`` and the model is one it computes exactly, else ``HFDecoder``."""
    return LeanLlama(model) if lean and LeanLlama.supports(model) else HFDecoder(model)


class LeanLlama:
    """Llama / Qwen2 forward on a ``KVCache`` from the HF model's modules (see the module docstring).

    Equal to HF's forward up to float rounding: the same RMSNorm (in float32, then the weight),
    the same rotary cos/sin (HF's own rotary module, tabulated per position when its frequencies
    do not depend on the sequence length), the same projection and MLP modules (the model is not
    modified: weights loaded into it are used as they are). A single new token on CPU attends
    with matmuls (the CPU SDPA kernel is slow for one query, see ``_attend_one``); everything else
    uses ``scaled_dot_product_attention``.
    """

    SHORT = 32  # contexts up to this many keys: see _attend_one

    def __init__(self, model: PreTrainedModel):
        self.model = model
        cfg = model.config
        self.n_kv = cfg.num_key_value_heads
        self.gqa = self.n_kv != cfg.num_attention_heads
        self._rope = _RopeTable(model.model.rotary_emb)

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        full = all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"]))
        sliding = bool(getattr(cfg, "use_sliding_window", False))
        return cfg.model_type in LEAN_MODEL_TYPES and full and not sliding and hasattr(model, "lm_head")

    def forward(self, ids_BT, pos_BT, mask_BK, cache: KVCache, logits: bool):
        m = self.model.model
        T0, (B, T) = cache.T, ids_BT.shape
        assert mask_BK.shape == (B, T0 + T) and cache.room >= T, (tuple(mask_BK.shape), T0, T, cache.room)
        x_BTE = m.embed_tokens(ids_BT)
        cos, sin = self._rope(x_BTE, pos_BT)  # (B, 1, T, D); sin with the rotation's sign folded in
        attn_mask = _attention_mask(mask_BK, T)
        for i, layer in enumerate(m.layers):
            h_BTE = _norm(layer.input_layernorm, x_BTE)
            x_BTE = x_BTE + self._attention(layer.self_attn, h_BTE, cos, sin, cache, i, attn_mask)
            mlp = layer.mlp
            h_BTE = _norm(layer.post_attention_layernorm, x_BTE)
            x_BTE = x_BTE + _linear(
                mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, h_BTE)) * _linear(mlp.up_proj, h_BTE)
            )
        cache.T = T0 + T
        return _linear(self.model.lm_head, _norm(m.norm, x_BTE[:, -1])) if logits else None

    def _attention(self, attn, h_BTE, cos, sin, cache: KVCache, i: int, attn_mask):
        (B, T, _), D, T0 = h_BTE.shape, attn.head_dim, cache.T
        q, k, v = (_linear(p, h_BTE).view(B, T, -1, D).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        # rotary (x cos + rotate_half(x) sin) with the keys written straight into the cache
        torch.mul(k, cos, out=cache.k[i, :, :, T0 : T0 + T]).addcmul_(k.roll(D // 2, -1), sin)
        cache.v[i, :, :, T0 : T0 + T] = v
        q = (q * cos).addcmul_(q.roll(D // 2, -1), sin)
        keys, values = cache.k[i, :, :, : T0 + T], cache.v[i, :, :, : T0 + T]
        if T == 1 and q.device.type == "cpu":
            o = self._attend_one(q, keys, values, attn.scaling, attn_mask)
        else:
            causal = attn_mask is None and T > 1
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=attn_mask, is_causal=causal, scale=attn.scaling, enable_gqa=self.gqa
            )
        return _linear(attn.o_proj, o.transpose(1, 2).reshape(B, T, -1))

    def _attend_one(self, q_BH1D, k_BhKD, v_BhKD, scale: float, attn_mask):
        """One query per row: the query heads of each kv head as a group, softmax in float32.

        Up to ``SHORT`` keys the softmax is spelled out and the weighted sum of values is a
        broadcast multiply-add: on CPU, for many rows of few keys, both are several times faster
        than ``softmax`` and a batched matmul (whose costs are per row); longer contexts use those."""
        B, H, _, D = q_BH1D.shape
        K = k_BhKD.shape[2]
        q_BhGD = q_BH1D.reshape(B, self.n_kv, H // self.n_kv, D)
        s_BhGK = torch.matmul(q_BhGD, k_BhKD.transpose(-1, -2)).float() * scale
        if attn_mask is not None:
            s_BhGK = s_BhGK.masked_fill(~attn_mask, float("-inf"))  # (B, 1, 1, K) broadcasts
        if K > self.SHORT:
            o_BhGD = torch.matmul(s_BhGK.softmax(-1).to(v_BhKD.dtype), v_BhKD)
        else:
            e_BhGK = (s_BhGK - s_BhGK.amax(-1, keepdim=True)).exp_()
            p_BhKG = e_BhGK.div_(e_BhGK.sum(-1, keepdim=True)).to(v_BhKD.dtype).transpose(-1, -2)
            o_BhGD = (p_BhKG[..., None] * v_BhKD[:, :, :, None]).sum(2)  # (B, h, K, G, D) summed over K
        return o_BhGD.reshape(B, H, 1, D)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` without the module call's hook machinery (a few
    microseconds per call, ~15 calls per forward). Subclasses (quantised, LoRA) are called."""
    return F.linear(x, module.weight, module.bias) if type(module) is torch.nn.Linear else module(x)


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm: normalise in float32, back to x's dtype, times the weight
    (one fused kernel when all of it is float32)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


class _RopeTable:
    """cos and sign-folded sin (B, 1, T, D) per position, from the model's rotary module.

    ``rotate_half(x) * sin == x.roll(D / 2) * sin'`` with ``sin'`` = sin with its first half
    negated, so applying rotary is two multiplies, a roll and an add. For rotary types whose
    frequencies do not depend on the sequence length the values are tabulated once per position
    (HF's own output for those positions, so equal to what it computes per call)."""

    STATIC_TYPES = ("default", "linear", "llama3", "yarn")

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") in self.STATIC_TYPES
        self.cos_sin = None  # (positions, 2 D): cos then folded sin

    def __call__(self, x_BTE: torch.Tensor, pos_BT: torch.Tensor):
        if not self.static:
            cos, sin = self._fold(*self.rotary(x_BTE, pos_BT))
            return cos[:, None], sin[:, None]
        need, table = int(pos_BT.max()) + 1, self.cos_sin
        if table is None or table.shape[0] < need or table.dtype != x_BTE.dtype:
            n = max(need, 2 * (0 if table is None else table.shape[0]), 64)
            pos = torch.arange(n, device=x_BTE.device)[None]
            self.cos_sin = torch.cat([t[0] for t in self._fold(*self.rotary(x_BTE[:1, :1], pos))], -1)
        return self.cos_sin[pos_BT][:, None].chunk(2, -1)

    @staticmethod
    def _fold(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = cos.shape[-1] // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], -1)


def _attention_mask(mask_BK: torch.Tensor, T: int):
    """Boolean (B, 1, T, K) mask, or None when plain causal attention is exact (no padding and
    the new tokens are the whole context, or a single new token).

    Query i (at column K - T + i) sees column j when j is not padding and j <= K - T + i; a
    padding query also sees itself, so no row is all-masked (its output is never attended to)."""
    B, K = mask_BK.shape
    keys_BK = mask_BK.bool()
    if bool(keys_BK.all()) and (T == 1 or T == K):
        return None
    col_TK = torch.arange(K, device=mask_BK.device)[None, :]
    at_T1 = torch.arange(K - T, K, device=mask_BK.device)[:, None]
    allowed = (keys_BK[:, None, :] & (col_TK <= at_T1)[None]) | (col_TK == at_T1)[None]
    return allowed[:, None]


class HFDecoder:
    """Any HF causal LM through its own ``forward``: the fallback behind ``LeanLlama``."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, ids_BT, pos_BT, mask_BK, cache: KVCache, logits: bool):
        T0, T = cache.T, ids_BT.shape[1]
        assert mask_BK.shape[1] == T0 + T and cache.room >= T, (tuple(mask_BK.shape), T0, T, cache.room)
        if T0:
            dyn = DynamicCache(
                ddp_cache_data=[(cache.k[i, :, :, :T0], cache.v[i, :, :, :T0]) for i in range(len(cache.k))]
            )
        else:
            dyn = DynamicCache(config=self.model.config)
        kw = dict(
            input_ids=ids_BT,
            attention_mask=None if bool(mask_BK.all()) else mask_BK,
            position_ids=pos_BT,
            use_cache=True,
            **{self.cache_kw: dyn},
        )
        # base_model: the decoder stack without lm_head when the logits are not wanted
        out = self.model(**kw, logits_to_keep=1).logits[:, -1] if logits else self.model.base_model(**kw)
        for i, layer in enumerate(dyn.layers):
            cache.k[i, :, :, T0 : T0 + T] = layer.keys[:, :, T0:]
            cache.v[i, :, :, T0 : T0 + T] = layer.values[:, :, T0:]
        cache.T = T0 + T
        return out if logits else None
