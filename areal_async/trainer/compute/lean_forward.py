"""The packed training forward of Llama / Qwen2 without HF's forward: logits of a ``PackedBatch``.

``lean_logits(model, packed)`` computes what ``model(input_ids, position_ids, cu_seq_lens...)``
computes with the 'packed_sdpa' attention (``packing._varlen_sdpa_forward``), from the model's
own modules and parameters (embedding, norms, projections, MLP, rotary embedding, lm head), so
gradients land on the model's parameters as they do through HF's forward. Why: on CPU at the
tiny scale HF's forward spends most of its time outside the arithmetic. Its rotary step adds a
head-major (transposed) view to a contiguous one, an elementwise add that ran at ~25 ns per
element (13 ms of a 15 ms forward for 2K tokens, hidden 64); here every per-token tensor stays
token-major, (T, heads, head dim), and rotary is two multiplies and a roll on it.

Same arithmetic as HF's Llama/Qwen2 layers, up to float rounding: RMSNorm in float32 then the
weight, rotary ``x cos + rotate_half(x) sin`` (written ``x cos + roll(x) sin'`` with the first
half of sin negated, the same products), the same causal attention per sequence (the varlen
plan's length buckets, one ``scaled_dot_product_attention`` each), ``down(act(gate) * up)``. A batch whose
samples share their prompt runs each prompt once (``shared_prefix``): the plan's buckets then carry the branch
masks.

Covered: Llama and Qwen2 with full attention (no sliding window), any GQA ratio, q/k/v biases,
tied embeddings, float32 or lower-precision weights, no attention dropout. Everything else
(other architectures, sliding windows, attention dropout > 0, a model wrapped by FSDP whose
parameters are gathered by its forward hooks, quantised or LoRA-wrapped projections are still
fine: they are called as modules) goes through HF's forward (``supports`` says which).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from areal_async.base import cores
from areal_async.models.lean_ops import STATIC_ROPE_TYPES
from areal_async.models.lean_ops import linear as _linear
from areal_async.models.lean_ops import rms_norm as _norm

LEAN_MODEL_TYPES = ("llama", "qwen2")


def supports(model: torch.nn.Module) -> bool:
    """True when ``lean_logits`` computes this model exactly (see the module docstring)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (
        all(t == "full_attention" for t in layer_types)
        and not getattr(cfg, "use_sliding_window", False)
        and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) == 0.0
        and hasattr(model, "lm_head")
        and hasattr(model, "model")
        and getattr(model.model.rotary_emb, "rope_type", "default") in STATIC_ROPE_TYPES
        and not _is_fsdp(model)
    )


def _is_fsdp(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``) modules gather their parameters in forward hooks, which the lean
    forward would skip."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed: nothing can be sharded
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def lean_logits(model: torch.nn.Module, ids_T: torch.Tensor, pos_T: torch.Tensor, plan) -> torch.Tensor:
    """(T, V) logits of the packed tokens ``ids_T`` at positions ``pos_T``; ``plan`` is the
    batch's ``packing.varlen_plan`` (sequences grouped into length buckets)."""
    return _linear(model.lm_head, lean_hidden(model, ids_T, pos_T, plan))


def lean_hidden(model: torch.nn.Module, ids_T: torch.Tensor, pos_T: torch.Tensor, plan) -> torch.Tensor:
    """(T, E) final-normed hidden states, the lm head's input (``lean_logits`` without the head).

    With HF's activation checkpointing on (``actor.enable_checkpointing``, for the config's
    ``actor.gradient_checkpointing``: it sets the base model's ``gradient_checkpointing``) and grad on,
    each decoder layer runs under ``torch.utils.checkpoint`` (non-reentrant): only its input is
    kept, its activations are recomputed in backward. With ``cluster.share_cores`` each layer's forward and
    backward first takes this worker's share of the CPUs (``base/cores.py``)."""
    m = model.model
    x_TE = m.embed_tokens(ids_T)
    cos_T1D, sin_T1D = _rope_table(model, x_TE.dtype, x_TE.device).lookup(pos_T)
    ckpt = torch.is_grad_enabled() and getattr(m, "gradient_checkpointing", False)  # set by HF's enable
    for layer in m.layers:
        x_TE = cores.pace(x_TE)  # cluster.share_cores: this layer's threads (and its backward's)
        if ckpt:
            x_TE = checkpoint(_layer, layer, x_TE, cos_T1D, sin_T1D, plan, use_reentrant=False)
        else:
            x_TE = _layer(layer, x_TE, cos_T1D, sin_T1D, plan)
    return _norm(m.norm, x_TE)


def _layer(layer: torch.nn.Module, x_TE: torch.Tensor, cos_T1D, sin_T1D, plan) -> torch.Tensor:
    x_TE = x_TE + _attention(layer.self_attn, _norm(layer.input_layernorm, x_TE), cos_T1D, sin_T1D, plan)
    mlp = layer.mlp
    h_TE = _norm(layer.post_attention_layernorm, x_TE)
    return x_TE + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, h_TE)) * _linear(mlp.up_proj, h_TE))


def _attention(attn, h_TE: torch.Tensor, cos_T1D, sin_T1D, plan) -> torch.Tensor:
    T, D = h_TE.shape[0], attn.head_dim
    q, k, v = (_linear(p, h_TE).view(T, -1, D) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = (_rotary(x, cos_T1D, sin_T1D) for x in (q, k))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # HF's repeat_kv: kv head j serves query heads j*groups .. (j+1)*groups-1
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    H = q.shape[1]
    q, k, v = (x.reshape(T, H * D) for x in (q, k, v))
    outs = []
    for b in plan.buckets:
        N, L = b.gather_NL.shape
        flat = b.gather_NL.reshape(-1)
        qb, kb, vb = (x.index_select(0, flat).view(N, L, H, D).transpose(1, 2) for x in (q, k, v))
        causal = b.mask is None  # else a shared prefix's branch mask (causal within the branches)
        o_NHLD = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, is_causal=causal, scale=attn.scaling)
        outs.append(o_NHLD.transpose(1, 2).reshape(N * L, H * D).index_select(0, b.real))
    o_TX = (torch.cat(outs) if len(outs) > 1 else outs[0]).index_select(0, plan.inverse_T)
    return _linear(attn.o_proj, o_TX)


def _rotary(x_THD: torch.Tensor, cos_T1D: torch.Tensor, sin_T1D: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, as x cos + roll(x, D/2) sin' (sin' = sin, first half negated)."""
    return torch.addcmul(x_THD * cos_T1D, x_THD.roll(x_THD.shape[-1] // 2, -1), sin_T1D)


class _RopeTable:
    """cos and sign-folded sin per position, (positions, 2 D), from the model's rotary module
    (its own output for those positions), grown on demand."""

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype):
        self.rotary, self.dtype = rotary, dtype
        self.table = None

    def lookup(self, pos_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(pos_T.max()) + 1
        if self.table is None or self.table.shape[0] < need:
            self._build(max(need, 64, 0 if self.table is None else 2 * self.table.shape[0]))
        cos_TD, sin_TD = self.table.index_select(0, pos_T).chunk(2, -1)
        return cos_TD[:, None], sin_TD[:, None]

    def _build(self, n: int) -> None:
        w = self.rotary.inv_freq
        probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=w.device)
        with torch.no_grad():
            cos, sin = self.rotary(probe, torch.arange(n, device=w.device)[None])
        half = cos.shape[-1] // 2
        self.table = torch.cat([cos[0], -sin[0, :, :half], sin[0, :, half:]], -1)


_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _rope_table(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> _RopeTable:
    per_model = _TABLES.setdefault(model, {})
    key = (dtype, device)
    if key not in per_model:
        per_model[key] = _RopeTable(model.model.rotary_emb, dtype)
    return per_model[key]
