"""The forward passes behind ``TorchEngine``: a preallocated KV cache and two decoders that fill it.

``KVCache`` holds a cohort's keys and values in one buffer per kind, columns outermost
(capacity, layers, then a layer's block: rows last on CPU): columns ``[0, T)`` hold tokens, later
columns are room for the tokens still to be decoded. A decode step writes one column in place
(one contiguous block per layer); nothing grows or is concatenated per step, and a row gather
copies only the filled columns, all layers in one call.

A decoder runs ``forward(ids_BT, pos_BT, mask_BK, cache, logits)``: the new tokens ``ids_BT`` at
positions ``pos_BT`` attend to the cache's ``T`` columns and to each other (causally), masked by
``mask_BK`` (K = T + the new tokens; 0 = left padding); their keys/values are written at
``[T, K)``; it returns the logits of the last position (B, V) when ``logits`` is true.

- ``LeanLlama``: Llama and Qwen2 (full attention, no sliding window) computed from the HF
  model's own modules (embedding, norms, projections, MLP, rotary embedding, lm head), so
  weights loaded into the HF model are used as they are; attention reads the cache buffer
  (``scaled_dot_product_attention``, or, for one query on CPU, elementwise products over the
  rows-last cache, see ``_attend_rows_last``). No HF cache object, no mask construction, no
  per-step output containers.
- ``HFDecoder``: any other causal LM through its own ``forward`` and a ``DynamicCache`` built on
  the filled columns (the fallback; slower, same results).

Not covered: sliding-window or hybrid attention in the lean path, paged memory, tensor parallelism.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
import transformers.activations
from transformers import DynamicCache, PreTrainedModel
from areal_async.models.lean_ops import STATIC_ROPE_TYPES
from areal_async.models.lean_ops import linear as _linear
from areal_async.models.lean_ops import onednn_mm, onednn_pays, onednn_usable
from areal_async.models.lean_ops import rms_norm as _norm
from areal_async.rollout.engines.kv_cache import KVCache

LEAN_MODEL_TYPES = ("llama", "qwen2")


# the layers' matmuls (``rollout.engine_linears``): the BLAS behind F.linear, oneDNN's on the weights as they are,
# or oneDNN's on a reordered copy of each weight (the lm head always, where oneDNN can: ``_OneDNN``); auto: onednn
# where it is the faster here (``onednn_pays``), else blas
LINEAR_KERNELS = ("auto", "blas", "onednn", "packed")


def make_decoder(model: PreTrainedModel, lean: bool = True, linears: str = "auto"):
    """``LeanLlama`` when ``lean`` and the model is one it computes exactly, else ``HFDecoder``."""
    if linears not in LINEAR_KERNELS:
        raise ValueError(f"linears={linears!r}: expected one of {LINEAR_KERNELS}")
    return LeanLlama(model, linears) if lean and LeanLlama.supports(model) else HFDecoder(model)


class LeanLlama:
    """Llama / Qwen2 forward on a ``KVCache`` from the HF model's modules (see the module docstring).

    Equal to HF's forward up to float rounding: the same RMSNorm (in float32, then the weight),
    the same rotary cos/sin (HF's own rotary module, tabulated per position when its frequencies
    do not depend on the sequence length), the same projection and MLP modules (the model is not
    modified: weights loaded into it are used as they are). A single new token on CPU attends
    with elementwise products over the cache (``_attend_rows_last``); everything else uses
    ``scaled_dot_product_attention``. In models of at most ``FUSE_MAX_PARAMS`` parameters, and in
    any model with ``linears`` packed, the q/k/v and the gate/up projections run as one matmul each
    over a concatenated copy of their weights (``_Cat``, rebuilt when a weight changes): at small
    sizes each call's fixed cost is most of its time; packed, the copy is kept only reordered (the
    bytes of the per-projection copies it replaces), and on SmolLM2-135M, 1 thread, a decode ran
    5-11 % more tokens/s fused than not (batch 8 and 64, two interleaved rounds). In float32
    those copies also carry the RMSNorm weight before them (W diag(g): the norm then only
    normalises) and the attention scaling on the query rows (the lm head gets the final norm's
    weight the same way); in other dtypes HF rounds the normalised activations before the weight
    multiply, so nothing is folded there. The layers' modules are looked up once, here.
    """

    FUSE_MAX_PARAMS = 20_000_000

    def __init__(self, model: PreTrainedModel, linears: str = "auto"):
        self.model = model
        cfg = model.config
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.gqa = self.n_kv != self.n_heads
        self._rope = _RopeTable(model.model.rotary_emb)
        if linears == "auto":  # judged on the MLP's up projection, the most common shape
            linears = "onednn" if onednn_pays(cfg.hidden_size, cfg.intermediate_size) else "blas"
        self.linears = linears
        # packed: the fused copies live only as their reordered form, so fusing costs no memory at any size
        packed = linears == "packed" and onednn_usable(model.lm_head.weight)
        fuse = packed or sum(p.numel() for p in model.parameters()) <= self.FUSE_MAX_PARAMS
        cats = "packed" if packed else "blas"
        self._layers = [_LayerPlan(layer, fuse, self.n_heads, linears, cats) for layer in model.model.layers]
        norm, head = model.model.norm, model.lm_head
        # the lm head on a reordered copy wherever oneDNN runs it: small models' a _Cat with the final norm's weight
        # folded in; else an _OneDNN of its own weight (packed, so no plain copy of the largest weight exists even
        # while the reordered one is made: the fold would save one (rows, hidden) multiply a step)
        fold_head = fuse and not packed and _Cat.foldable((head,), norm)
        self._head = _Cat((head,), norm, kernel="packed") if fold_head else None
        # the modules every forward uses, looked up once (nn.Module.__getattr__ costs ~1.4 us a lookup)
        self._embed_tokens, self._final_norm, self._lm_head = model.model.embed_tokens, norm, head
        plain = self._head is None and type(head) is torch.nn.Linear
        self._packed = _OneDNN(_weights_of(head), True) if plain and _OneDNN.usable(head.weight) else None

    def _logits(self, x_BE: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            return self._head(_rms(x_BE, self._final_norm.variance_epsilon))
        h_BE = _norm(self._final_norm, x_BE)
        return self._packed(h_BE) if self._packed is not None else _linear(self._lm_head, h_BE)

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        full = all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"]))
        sliding = bool(getattr(cfg, "use_sliding_window", False))
        return cfg.model_type in LEAN_MODEL_TYPES and full and not sliding and hasattr(model, "lm_head")

    def forward(self, ids_BT, pos_BT, mask_BK, cache: KVCache, logits: bool):
        T0, (B, T) = cache.T, ids_BT.shape
        assert mask_BK.shape == (B, T0 + T) and cache.room >= T, (tuple(mask_BK.shape), T0, T, cache.room)
        if T == 1 and cache.layout == "rows_last":
            x_BE = self._decode_one(ids_BT, pos_BT, mask_BK, cache)
        elif T == 1 and cache.layout == "heads":
            x_BE = self._decode_heads(ids_BT, pos_BT, mask_BK, cache)
        else:
            x_BE = self._forward_many(ids_BT, pos_BT, mask_BK, cache)
        cache.T = T0 + T
        return self._logits(x_BE) if logits else None

    def _forward_many(self, ids_BT, pos_BT, mask_BK, cache: KVCache) -> torch.Tensor:
        """Any number of new tokens (prefill; decode off CPU): the last position's hidden state (B, E).
        The last layer writes every position's keys and values but computes the rest (attention
        output, MLP) for the last position only: nothing else of it is returned."""
        x_BTE = self._embed_tokens(ids_BT)
        cos, sin = self._rope(x_BTE, pos_BT)  # (B, T, 1, D); sin with the rotation's sign folded in
        attn_mask = _attention_mask(mask_BK, ids_BT.shape[1])
        last = len(self._layers) - 1
        for i, lp in enumerate(self._layers):
            o_BTE = self._attention(lp, lp.attn_in(x_BTE), cos, sin, cache, i, attn_mask, i == last)
            x_BTE = (x_BTE[:, -1:] if i == last else x_BTE) + o_BTE
            x_BTE = x_BTE + lp.mlp(lp.mlp_in(x_BTE))
        return x_BTE[:, -1]

    def _attention(self, lp: "_LayerPlan", h_BTE, cos, sin, cache: KVCache, i: int, attn_mask, last_only: bool):
        """Attention output (B, T, E) of the new tokens, or of the last one only (B, 1, E)."""
        (B, T, _), T0, H = h_BTE.shape, cache.T, self.n_heads
        qk, v = lp.qk_v(h_BTE, H + self.n_kv)
        qk = _rotary(qk, cos, sin)  # (B, T, H + h, D): queries then keys
        cache.write(i, T0, qk[:, :, H:], v)
        if T0 == 0:  # nothing cached before: the new keys as they are (contiguous head dims)
            keys, values = qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
        else:
            keys, values = cache.bhkd("k", i, T0 + T), cache.bhkd("v", i, T0 + T)
        q = qk[:, -1:, :H] if last_only else qk[:, :, :H]
        if last_only and attn_mask is not None:
            attn_mask = attn_mask[:, :, -1:]
        causal = attn_mask is None and q.shape[1] > 1
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=attn_mask,
            is_causal=causal,
            scale=lp.attn_scale,
            enable_gqa=self.gqa,
        )
        return lp.linear(lp.o_proj, o.transpose(1, 2).reshape(B, q.shape[1], -1))

    def _decode_one(self, ids_B1, pos_B1, mask_BK, cache: KVCache) -> torch.Tensor:
        """One new token per row on CPU: activations (B, E), projections computed transposed as
        (heads, D, B) (a matmul writes them so; no copy), each layer's new key and value written as
        one block of the rows-last cache, attention by ``_attend_rows_last`` into buffers shared by
        the layers, the residual adds fused into the output projections (``_LayerPlan.add_out``).
        Every per-layer view of the cache is taken once per step (``unbind``)."""
        T0, H, h = cache.T, self.n_heads, self.n_kv
        x_BE = self._embed_tokens(ids_B1)[:, 0]
        # a position never exceeds its cache column (left padding only lowers it): T0 bounds them all
        cos, sin = self._rope.rows_last(x_BE, pos_B1.view(-1), T0 + 1)  # (D, B)
        pad_KB = None if bool(mask_BK.all()) else (mask_BK == 0).t()
        k_new, v_new = cache.k[T0].unbind(0), cache.v[T0].unbind(0)  # per layer: (h, D, B) blocks
        keys, values = cache.k[: T0 + 1].unbind(1), cache.v[: T0 + 1].unbind(1)  # per layer: (K, h, D, B)
        bufs = _AttnBuffers(T0 + 1, H, h, cache.k.shape[3], x_BE.shape[0], x_BE.device)
        for i, lp in enumerate(self._layers):
            qk, v = lp.qkv_t(lp.attn_in(x_BE)).split((H + h, h))  # (H + 2 h, D, B): queries, keys, values
            q, k = _rotary(qk, cos, sin, dim=1).split((H, h))
            k_new[i].copy_(k)
            v_new[i].copy_(v)
            o_DB = _attend_rows_last(q, keys[i], values[i], lp.attn_scale, pad_KB, bufs)
            x_BE = lp.add_out(lp.o_proj, x_BE, o_DB.t())
            x_BE = lp.add_out(lp.down, x_BE, lp.gated(lp.mlp_in(x_BE)))
        return x_BE

    def _decode_heads(self, ids_B1, pos_B1, mask_BK, cache: KVCache) -> torch.Tensor:
        """One new token per row on a ``heads`` cache (CPU, head dims >= 64): activations (B, E), each
        layer's new keys and values written into column T0 of its (B, h, C, D) blocks, attention by
        ``_attend_heads`` (batched matmuls over each row's and kv head's contiguous keys), the residual
        adds fused into the output projections (``_LayerPlan.add_out``)."""
        T0, H, h = cache.T, self.n_heads, self.n_kv
        x_BE = self._embed_tokens(ids_B1)[:, 0]
        cos, sin = (c[:, 0] for c in self._rope(x_BE[:, None], pos_B1))  # (B, 1, D)
        pad_BK = None if bool(mask_BK.all()) else mask_BK == 0
        for i, lp in enumerate(self._layers):
            qk, v = lp.qk_v(lp.attn_in(x_BE), H + h)  # (B, H + h, D), (B, h, D)
            qk = _rotary(qk, cos, sin)
            keys, values = cache.layer("k", i, T0 + 1), cache.layer("v", i, T0 + 1)  # (B, h, K, D) views
            keys[:, :, T0] = qk[:, H:]
            values[:, :, T0] = v
            o_BX = _attend_heads(qk[:, :H], keys, values, lp.attn_scale, pad_BK)
            x_BE = lp.add_out(lp.o_proj, x_BE, o_BX)
            x_BE = lp.add_out(lp.down, x_BE, lp.gated(lp.mlp_in(x_BE)))
        return x_BE


class _LayerPlan:
    """One decoder layer's modules, looked up once, with the projections that read the same input
    fused (``_Cat``) when ``fuse`` and they are plain ``nn.Linear`` layers alike in bias; in
    float32 with the norm weight before them and the attention scaling folded in (``folded``:
    ``attn_in``/``mlp_in`` then only normalise, and ``attn_scale`` is 1)."""

    def __init__(self, layer: torch.nn.Module, fuse: bool, n_heads: int, linears: str = "blas", cats: str = "blas"):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj, self.scaling, self.head_dim = attn.o_proj, attn.scaling, attn.head_dim
        self.down, self.act = mlp.down_proj, mlp.act_fn
        self.qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up = (mlp.gate_proj, mlp.up_proj)
        self.folded = fuse and _Cat.foldable(self.qkv, self.norm1) and _Cat.foldable(self.gate_up, self.norm2)
        if self.folded:
            q_rows = n_heads * self.head_dim
            self.qkv_cat = _Cat(self.qkv, self.norm1, scaled_rows=q_rows, row_scale=self.scaling, kernel=cats)
            self.gate_up_cat = _Cat(self.gate_up, self.norm2, kernel=cats)
        else:
            self.qkv_cat = _Cat(self.qkv, kernel=cats) if fuse and _Cat.fusable(self.qkv) else None
            self.gate_up_cat = _Cat(self.gate_up, kernel=cats) if fuse and _Cat.fusable(self.gate_up) else None
        self.attn_scale = 1.0 if self.folded else self.scaling
        self.silu = type(self.act) in _SILU_TYPES  # called as F.silu (no module call)
        # the projections not fused, on oneDNN's matmul where it runs them (module -> its _OneDNN)
        mods = [m for m, cat in ((self.qkv, self.qkv_cat), (self.gate_up, self.gate_up_cat)) if cat is None]
        plain = [m for m in (*sum(mods, ()), self.o_proj, self.down) if type(m) is torch.nn.Linear]
        if linears == "blas":
            plain = []
        self.dnn = {m: _OneDNN(_weights_of(m), linears == "packed") for m in plain if _OneDNN.usable(m.weight)}

    def linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``: on oneDNN where ``dnn`` holds it, else ``lean_ops.linear``."""
        dnn = self.dnn.get(module)
        return _linear(module, x) if dnn is None else dnn(x)

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        """The attention's input: the pre-attention RMSNorm of ``x`` (its weight folded or not)."""
        return _rms(x, self.norm1.variance_epsilon) if self.folded else _norm(self.norm1, x)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's input: the post-attention RMSNorm of ``x`` (its weight folded or not)."""
        return _rms(x, self.norm2.variance_epsilon) if self.folded else _norm(self.norm2, x)

    def qk_v(self, h: torch.Tensor, n_qk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (..., n_qk heads, D) and values (..., kv heads, D) of ``h`` (..., E)."""
        D = self.head_dim
        if self.qkv_cat is not None:
            qkv = self.qkv_cat(h)
            qkv = qkv.view(*qkv.shape[:-1], -1, D)
            return qkv[..., :n_qk, :], qkv[..., n_qk:, :]
        q, k, v = (self.linear(p, h) for p in self.qkv)
        return torch.cat([q, k], -1).view(*h.shape[:-1], n_qk, D), v.view(*h.shape[:-1], -1, D)

    def qkv_t(self, h_BE: torch.Tensor) -> torch.Tensor:
        """Queries, keys and values of ``h_BE`` transposed: (H + 2 h, D, B)."""
        if self.qkv_cat is not None and self.qkv_cat.kernel == "packed":  # no plain copy to multiply from the left
            out = self.qkv_cat(h_BE).t().contiguous()
        elif self.qkv_cat is not None:
            w, b = self.qkv_cat.weights()
            out = torch.mm(w, h_BE.t()) if b is None else torch.addmm(b[:, None], w, h_BE.t())
        else:
            out = torch.cat([self.linear(p, h_BE) for p in self.qkv], -1).t()
        return out.view(-1, self.head_dim, h_BE.shape[0])

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """HF's gated MLP: down(act(gate(h)) * up(h))."""
        return self.linear(self.down, self.gated(h))

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP before its down projection: act(gate(h)) * up(h)."""
        if self.gate_up_cat is not None:
            gate, up = self.gate_up_cat(h).chunk(2, -1)
        else:
            gate, up = (self.linear(p, h) for p in self.gate_up)
        return (F.silu(gate) if self.silu else self.act(gate)) * up

    def add_out(self, proj: torch.nn.Module, x_BE: torch.Tensor, h_BI: torch.Tensor) -> torch.Tensor:
        """``x_BE + proj(h_BI)`` (2D): one ``addmm`` for a plain bias-free ``nn.Linear`` of x's
        dtype (the add done by the matmul) not on oneDNN, else the projection and an add."""
        w = proj.weight if type(proj) is torch.nn.Linear and proj.bias is None and proj not in self.dnn else None
        if w is None or w.dtype != x_BE.dtype:
            return x_BE + self.linear(proj, h_BI)
        return torch.addmm(x_BE, h_BI, w.t())


class _Cat:
    """One matmul for several plain ``nn.Linear`` layers reading one input: a concatenated copy of
    their weights (and biases), rebuilt whenever a source tensor changed, i.e. its storage or its
    version counter, which every in-place update bumps (``copy_``, optimizer steps,
    ``load_state_dict``). The model itself is never modified.

    ``norm``: an RMSNorm whose weight g is folded in (W diag(g): the layers then read the
    normalised input without g); ``scaled_rows``: that many first output rows (weight and bias)
    times ``row_scale``. ``kernel``: ``blas`` (F.linear on the copy) or ``packed`` (where oneDNN runs it, CPU
    float32: oneDNN's matmul on the copy reordered for it, the plain copy then dropped, so the fused form costs
    the weights' bytes once; ``weights`` then returns the reordered weight)."""

    def __init__(
        self,
        modules: tuple[torch.nn.Module, ...],
        norm: torch.nn.Module | None = None,
        scaled_rows: int = 0,
        row_scale: float = 1.0,
        kernel: str = "blas",
    ):
        self.modules, self.norm, self.key = modules, norm, None
        self.kernel = "packed" if kernel == "packed" and onednn_usable(modules[0].weight) else "blas"
        self._params = [m._parameters for m in (*modules, *(() if norm is None else (norm,)))]
        self.scaled_rows, self.row_scale = scaled_rows, row_scale
        self.w = self.b = None

    @staticmethod
    def fusable(modules) -> bool:
        if not all(type(m) is torch.nn.Linear for m in modules):
            return False
        w0 = modules[0].weight
        same = all(m.weight.dtype == w0.dtype and m.weight.device == w0.device for m in modules)
        return same and len({m.bias is None for m in modules}) == 1

    @staticmethod
    def foldable(modules, norm: torch.nn.Module) -> bool:
        """``fusable``, float32, and ``norm`` an RMSNorm (weight and ``variance_epsilon``) in float32
        on their device: folding its weight in is then exact up to float rounding."""
        if not _Cat.fusable(modules):  # e.g. a LoRA-wrapped projection, which has no .weight of its own
            return False
        g = getattr(norm, "weight", None)
        w0 = modules[0].weight
        plain = isinstance(g, torch.Tensor) and isinstance(getattr(norm, "variance_epsilon", None), float)
        return (
            plain
            and w0.dtype == torch.float32
            and g.dtype == torch.float32
            and g.device == w0.device
            and type(norm).__name__ in _RMS_NORMS
        )

    def weights(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The concatenated weight and bias (None without biases), current; the weight reordered for oneDNN (for
        ``rows`` rows, at a rebuild) when ``kernel`` is packed."""
        # the modules' parameter dicts read directly: nn.Module.__getattr__ costs ~1.4 us a lookup,
        # ~15 us a call here with seven lookups (every projection of every step calls this)
        key = [(t.data_ptr(), t._version) for d in self._params for t in (d["weight"], d.get("bias")) if t is not None]
        if key != self.key:
            self._build()
            if self.kernel == "packed":
                with torch.no_grad():
                    self.w = torch.ops.mkldnn._reorder_linear_weight(self.w, max(1, rows))
            self.key = key
        return self.w, self.b

    @torch.no_grad()
    def _build(self) -> None:
        w = torch.cat([m.weight for m in self.modules])  # a copy, even of one module
        b = None if self.modules[0].bias is None else torch.cat([m.bias for m in self.modules])
        if self.norm is not None:
            w.mul_(self.norm.weight[None, :])
        if self.scaled_rows:
            w[: self.scaled_rows].mul_(self.row_scale)
            if b is not None:
                b[: self.scaled_rows].mul_(self.row_scale)
        self.w, self.b = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "blas":
            return F.linear(x, *self.weights())
        w, b = self.weights(x.numel() // x.shape[-1])
        return _onednn_linear(x, w, b)


class _OneDNN:
    """A linear layer (CPU, float32) on oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``). ``packed``:
    on a copy of the weight reordered once for it, rebuilt when the weight changes: the same tensor object
    (kept referenced, so its identity cannot be reused) at the same version counter, which every in-place update
    bumps (an inference tensor, which has none, is replaced, never changed); else on the weight as it is (no
    copy; oneDNN reorders it each call). Where the BLAS behind ``F.linear`` (MKL) runs a slower path, as on this
    AMD CPU, both are faster. Measured here (1 thread, SmolLM2's shapes): the 49,152 x 576 head packed took
    12 / 30 / 52 ms for 8 / 32 / 64 rows where ``F.linear`` took 22 / 39 / 63 (a loaded machine, the 25th
    percentile of 25); a decode step's 30 layers of linears 31.8 (as is) and 20.5 ms (packed) for 8 rows where
    ``torch.mm`` took 44.7, 78 and 65 ms for 64 rows where it took 150 (benchmarks.real_model generation: the
    engine's tokens/s in docs/performance-notes.md). A packed copy costs the weight's bytes again (113 MB for
    SmolLM2's head). Float32 rounding of another summation order: logits within 1e-5 of float64 (F.linear's
    within 3e-6), a 576-wide product within ~1e-4 of float64 where F.linear's is within ~5e-5."""

    def __init__(self, weights, packed: bool):
        self.weights = weights  # -> (weight, bias or None), current
        self.pack = packed
        self.src = self.version = self.packed = None

    usable = staticmethod(onednn_usable)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weights()
        if self.pack:
            version = None if w.is_inference() else w._version  # inference tensors have no version counter
            if w is not self.src or version != self.version:
                with torch.no_grad():
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), max(1, x.numel() // x.shape[-1]))
                self.src, self.version = w, version
            w = self.packed
        return _onednn_linear(x, w, b)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x w^T (+ b) over x's last dimension on oneDNN's matmul (``w`` as it is or reordered), x of any rank."""
    return onednn_mm(x.reshape(-1, x.shape[-1]).contiguous(), w, b).view(*x.shape[:-1], -1)


def _weights_of(module: torch.nn.Linear):
    """-> a plain ``nn.Linear``'s current (weight, bias), read from its parameter dict (no module lookup)."""
    params = module._parameters
    return lambda: (params["weight"], params["bias"])


_SILU_TYPES = (torch.nn.SiLU, getattr(transformers.activations, "SiLUActivation", torch.nn.SiLU))
# RMSNorm classes computing weight * (x * rsqrt(mean(x^2) + eps)) in float32 (``_Cat.foldable``)
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (float32 ``x``): the folded layers' input. HF's own arithmetic
    (``x * rsqrt(mean(x^2) + eps)``) in four ops: ``F.rms_norm`` on CPU runs more (dtype casts
    included), ~60 us a batch more on the issue-9 small case (paired A/B, 28/40 blocks)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """HF's ``x cos + rotate_half(x) sin`` along the head dimension ``dim``, with the sign folded
    into ``sin`` (``_RopeTable``)."""
    return (x * cos).addcmul_(x.roll(x.shape[dim] // 2, dim), sin)


class _AttnBuffers:
    """Scratch tensors for ``_attend_rows_last`` at one shape (K keys, H query and h kv heads,
    head dim D, B rows), shared by the layers of one decode step: the elementwise products
    (K, h, H / h, D, B), the scores (K, h, H / h, B) and the output (h, H / h, D, B). Writing into
    them (``out=``) instead of new tensors saves ~20 % of the attention's time at small shapes."""

    def __init__(self, K: int, H: int, h: int, D: int, B: int, device: torch.device):
        dtype = torch.float32  # attention is computed in float32 whatever the cache's dtype
        self.prod = torch.empty((K, h, H // h, D, B), dtype=dtype, device=device)
        self.scores = torch.empty((K, h, H // h, B), dtype=dtype, device=device)
        self.out = torch.empty((h, H // h, D, B), dtype=dtype, device=device)


def _attend_rows_last(q_HDB, k_KhDB, v_KhDB, scale: float, pad_KB, bufs: _AttnBuffers | None = None):
    """One query per row over K cached keys (rows-last cache; ``pad_KB`` True at padding, or
    None): the query heads of each kv head as a group, softmax in float32 -> (H * D, B), a view
    of ``bufs.out`` when ``bufs`` is given (valid until the next call with them).

    On CPU, for many rows of few keys, this is several times faster than ``softmax`` and batched
    matmuls (whose costs are per row and head): every product and reduction (over head dims, over
    keys) runs with the rows as the contiguous inner loop. Non-float32 caches are computed in
    float32 (no rounding per product)."""
    H, D, B = q_HDB.shape
    K, h = k_KhDB.shape[:2]
    dtype = q_HDB.dtype
    if dtype != torch.float32:
        q_HDB, k_KhDB, v_KhDB = q_HDB.float(), k_KhDB.float(), v_KhDB.float()
    bufs = bufs or _AttnBuffers(K, H, h, D, B, q_HDB.device)
    k_Kh1DB, v_Kh1DB = k_KhDB.unsqueeze(2), v_KhDB.unsqueeze(2)
    s_KhGB = torch.sum(torch.mul(q_HDB.view(h, H // h, D, B), k_Kh1DB, out=bufs.prod), 3, out=bufs.scores)
    if scale != 1.0:
        s_KhGB.mul_(scale)
    if pad_KB is not None:
        s_KhGB.masked_fill_(pad_KB[:, None, None], float("-inf"))
    p_KhG1B = torch.softmax(s_KhGB, 0).unsqueeze(3)  # over the keys (outermost: vectorised over the rows)
    o = torch.sum(torch.mul(p_KhG1B, v_Kh1DB, out=bufs.prod), 0, out=bufs.out).view(H * D, B)
    return o if o.dtype == dtype else o.to(dtype)


def _attend_heads(q_BHD, k_BhKD, v_BhKD, scale: float, pad_BK):
    """One query per row over K cached keys of a ``heads`` cache (``pad_BK`` True at padding, or None):
    each kv head's query heads as a group, (B h, G, D) x (B h, D, K) batched matmuls, softmax in the
    cache's dtype (float32 here) -> (B, H * D). The keys of a (row, kv head) are one contiguous (K, D)
    block of the cache, so the (B h, K, D) operands are views: nothing is copied but the query."""
    (B, H, D), (h, K) = q_BHD.shape, k_BhKD.shape[1:3]
    q_XGD = q_BHD.reshape(B * h, H // h, D)  # query head j reads kv head j // G (HF's repeat_kv)
    s_XGK = torch.bmm(q_XGD, k_BhKD.reshape(B * h, K, D).transpose(1, 2))
    if scale != 1.0:
        s_XGK.mul_(scale)
    if pad_BK is not None:
        s_XGK.view(B, -1, K).masked_fill_(pad_BK[:, None], float("-inf"))
    o_XGD = torch.bmm(torch.softmax(s_XGK, -1), v_BhKD.reshape(B * h, K, D))
    return o_XGD.view(B, H * D)


class _RopeTable:
    """cos and sign-folded sin (B, T, 1, D) per position, from the model's rotary module.

    ``rotate_half(x) * sin == x.roll(D / 2) * sin'`` with ``sin'`` = sin with its first half
    negated, so applying rotary is two multiplies, a roll and an add. For rotary types whose
    frequencies do not depend on the sequence length the values are tabulated once per position
    (HF's own output for those positions, so equal to what it computes per call)."""

    STATIC_TYPES = STATIC_ROPE_TYPES

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") in self.STATIC_TYPES
        self.cos_sin = None  # (positions, 2 D): cos then folded sin
        self.cos_sin_t = None  # the same transposed

    def __call__(self, x_BTE: torch.Tensor, pos_BT: torch.Tensor):
        if not self.static:
            cos, sin = self._fold(*self.rotary(x_BTE, pos_BT))
            return cos[:, :, None], sin[:, :, None]
        self._cover(x_BTE, int(pos_BT.max()) + 1)
        B, T = pos_BT.shape
        return self.cos_sin.index_select(0, pos_BT.reshape(-1)).view(B, T, 1, -1).chunk(2, -1)

    def rows_last(self, x_BE: torch.Tensor, pos_B: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and folded sin (D, B), contiguous, of one position per row (``x_BE``: the rows'
        activations, for the dtype and device; ``bound``: above every position, known to the
        caller without reading ``pos_B``)."""
        if not self.static:
            return tuple(c[:, 0, 0].t().contiguous() for c in self(x_BE[:, None], pos_B[:, None]))
        self._cover(x_BE, bound)
        cs = self.cos_sin_t.index_select(1, pos_B)
        return cs.chunk(2, 0)

    def _cover(self, x: torch.Tensor, need: int) -> None:
        """Tabulate at least positions [0, need) in x's dtype (doubling, so rarely)."""
        table = self.cos_sin
        if table is None or table.shape[0] < need or table.dtype != x.dtype:
            n = max(need, 2 * (0 if table is None else table.shape[0]), 64)
            pos = torch.arange(n, device=x.device)[None]
            one = x.reshape(-1, x.shape[-1])[:1, None]  # (1, 1, E): the rotary module reads dtype and device
            self.cos_sin = torch.cat([t[0] for t in self._fold(*self.rotary(one, pos))], -1)
            self.cos_sin_t = self.cos_sin.t().contiguous()  # (2 D, positions): rows_last's layout

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
            layers = range(cache.k.shape[cache.layer_dim])
            dyn = DynamicCache(ddp_cache_data=[(cache.bhkd("k", i, T0), cache.bhkd("v", i, T0)) for i in layers])
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
            cache.write(i, T0, layer.keys[:, :, T0:].transpose(1, 2), layer.values[:, :, T0:].transpose(1, 2))
        cache.T = T0 + T
        return out if logits else None
