"""Sequence packing (no padding) and the packed forward (micro-batches under a token budget are
allocated in ``micro_batches.py``).

Covered:
- ``pack``: variable-length sequences -> one 1D token tensor, ``cu_seqlens`` (cumulative
  lengths, int32, N+1 entries) and position ids that restart at 0 for each sequence;
- attention confined to each sequence, chosen by the model's ``attn_implementation``:
  'eager'/'sdpa': a block-diagonal causal additive 4D mask of shape (1, 1, T, T);
  'packed_sdpa' (registered here, see ``select_attn_implementation``/``use_varlen_attention``):
  sequences grouped into buckets of similar length, right-padded, one causal sdpa call per
  bucket, no mask, O(sum L_i^2) up to the bucket padding - the fast CPU path;
  'flash_attention_2'/'_3' (GPU, optional, never imported here): the varlen kernel.
  The last two get ``cu_seq_lens_q/k`` through transformers' attention kwargs.
  transformers 5.24 infers packing from restarting position ids only when no mask and no
  cache are passed (with the default ``use_cache`` in eval mode it silently attends across
  sequences), so the sequence boundaries are always passed explicitly, never left to that;
- ``forward_packed``: per-token logprobs of token t+1 given its prefix (log_softmax(logits/T))
  and, on request, the entropy of each next-token distribution; ``unpack`` scatters them back;

Not covered: context parallelism (a sequence split across devices), padding to a multiple for
kernels that want it. The dense mask is O(T^2) memory: fine for tests and small budgets;
'packed_sdpa' and flash-attn varlen avoid it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from areal_async.trainer.compute import lean_forward
from areal_async.models.lean_ops import linear as module_linear
from areal_async.trainer.compute.chunked_head import DEFAULT_CHUNK_TOKENS, head_logprobs, whole_logprobs
from areal_async.trainer.compute.shared_prefix import SharedPrefix, branch_mask
from protocols.trajectories import Segmented

_FLASH_IMPLS = ("flash_attention_2", "flash_attention_3")
_MASK_IMPLS = ("eager", "sdpa")


# --------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """Sequences laid end to end: ids_T[cu_seqlens[i]:cu_seqlens[i+1]] is sequence i."""

    ids_T: torch.Tensor  # int64 (T,)
    position_ids_T: torch.Tensor  # int64 (T,), restarting at 0 per sequence (and per segment)
    cu_seqlens: torch.Tensor  # int32 (N+1,)
    max_seqlen: int
    # attention's boundaries when some sequence is ``Segmented`` (finer than cu_seqlens: each segment attends
    # only within itself); None: the sequences' own
    attn_cu: Optional[torch.Tensor] = None
    attn_max: int = 0
    # the positions whose logprobs (entropies) are read, int64 ascending (the trainer's: each sequence's output
    # tokens' scorers, ``logprobs.tail_index``): ``forward_packed`` runs the lm head on these alone and returns 0
    # elsewhere, as TRL's ``logits_to_keep`` does; None: every position
    scored_T: Optional[torch.Tensor] = None
    # the runs of sequences that share their prompt laid out once (``shared_prefix``): the lean forward runs
    # these tokens and gathers each position's hidden state back; None (or another forward): the sequences
    shared: Optional[SharedPrefix] = None

    @property
    def lengths(self) -> list[int]:
        return self.cu_seqlens.diff().tolist()

    @property
    def layer_tokens(self) -> int:
        """Tokens the lean forward runs through the layers: the shared layout's, else every packed token."""
        return self.ids_T.numel() if self.shared is None else self.shared.tokens

    @property
    def attention_cu(self) -> torch.Tensor:
        return self.cu_seqlens if self.attn_cu is None else self.attn_cu

    @property
    def attention_max(self) -> int:
        return self.max_seqlen if self.attn_cu is None else self.attn_max

    def to(self, device: torch.device | str) -> "PackedBatch":
        attn = None if self.attn_cu is None else self.attn_cu.to(device)
        scored = None if self.scored_T is None else self.scored_T.to(device)
        return PackedBatch(
            self.ids_T.to(device),
            self.position_ids_T.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            attn,
            self.attn_max,
            scored,
            None if self.shared is None else self.shared.to(device),
        )


Seq = Union[Sequence[int], torch.Tensor, tuple[torch.Tensor, ...], Segmented]


def pack(seqs: Sequence[Seq]) -> PackedBatch:
    """Concatenate token-id sequences with no padding: one copy of each token into the packed buffer.
    The packed batch is on the host; sequences on one device are concatenated there and copied once
    (``forward_packed`` moves the packed batch to the model's device once); mixed devices are refused.

    A sequence is a 1D integer tensor (int32 or int64: kept as is until that copy), a list of
    ints, or a tuple of 1D tensors laid end to end (a trajectory's prompt and output, so they
    are not concatenated first). No per-token Python work: position ids are slices of one
    cached ``arange`` (``torch.repeat_interleave`` ran at ~10 M tokens/s here, 1/40 of a copy).
    """
    if not seqs:
        raise ValueError("pack() got no sequences; expected at least one")
    pieces, lengths, spans, host = [], [], [], True
    for i, s in enumerate(seqs):
        n = 0
        for x in _parts(s):
            t = _id_tensor(x, i)
            pieces.append(t)
            host = host and t.is_cpu
            n += t.numel()
        if n == 0:
            raise ValueError(f"sequence {i} is empty; expected >= 1 token each")
        lengths.append(n)
        spans += _spans(s, n, i)
    ids_T = torch.empty(sum(lengths), dtype=torch.long)
    if host:  # numpy widens int32 -> int64 ~2x faster than torch.cat
        np.concatenate([p.numpy() for p in pieces], out=ids_T.numpy())
    else:  # one kernel on their device, one copy to the host (the packed batch is built on the host)
        ids_T.copy_(one_device_cat(pieces, "the sequences' token ids"))
    longest = max(lengths)
    ramp = _ramp(longest)
    position_ids_T = torch.empty_like(ids_T)
    np.concatenate([ramp[:n] for n in spans], out=position_ids_T.numpy())
    cu_seqlens = torch.from_numpy(np.array([0, *itertools.accumulate(lengths)], dtype=np.int32))
    if len(spans) == len(lengths):
        return PackedBatch(ids_T, position_ids_T, cu_seqlens, longest)
    attn_cu = torch.from_numpy(np.array([0, *itertools.accumulate(spans)], dtype=np.int32))
    return PackedBatch(ids_T, position_ids_T, cu_seqlens, longest, attn_cu, max(spans))


def _parts(s) -> tuple:
    if isinstance(s, Segmented):
        return s.parts
    return s if _is_parts(s) else (s,)


def _spans(s, n: int, i: int) -> list[int]:
    """Lengths of the attention segments of sequence ``i`` (``n`` tokens): [n] unless it is ``Segmented``."""
    if not isinstance(s, Segmented):
        return [n]
    bounds = [0, *s.breaks, n]
    if any(not a < b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"sequence {i}: segment breaks {list(s.breaks)[:8]}; expected increasing offsets in (0, {n})")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def one_device_cat(pieces: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``torch.cat`` (dtypes promoted) of tensors that share one device; ``ValueError`` naming the devices
    when they do not (the trainer keeps trajectories on the host: ``transport.frames.to_host``)."""
    devices = {p.device for p in pieces}
    if len(devices) > 1:
        raise ValueError(f"{what} are on {sorted(map(str, devices))}; expected all on one device")
    return torch.cat(list(pieces))


def seq_len(s: Seq) -> int:
    """Tokens in one ``pack`` sequence (a tuple of tensors, or a ``Segmented``, counts its parts' tokens)."""
    if isinstance(s, Segmented):
        return sum(x.numel() for x in s.parts)
    return sum(x.numel() for x in s) if _is_parts(s) else len(s)


def _is_parts(s) -> bool:
    if not isinstance(s, tuple) or not s:
        return False
    for x in s:  # a loop, not all(<generator>): pack calls this per sequence
        if not isinstance(x, torch.Tensor):
            return False
    return True


_ID_DTYPES = (torch.int32, torch.int64)


def _id_tensor(s, i: int) -> torch.Tensor:
    t = s if isinstance(s, torch.Tensor) else torch.as_tensor(s, dtype=torch.long)
    if t.dtype not in _ID_DTYPES:
        t = t.long()
    if t.dim() != 1:
        raise ValueError(f"sequence {i}: token ids of shape {tuple(t.shape)}; expected a 1D tensor or list")
    return t


_RAMP = [np.arange(4096, dtype=np.int64)]


def _ramp(n: int) -> np.ndarray:
    """0, 1, ..., >= n-1 (int64), grown on demand and shared by every ``pack``."""
    if _RAMP[0].size < n:
        _RAMP[0] = np.arange(max(n, 2 * _RAMP[0].size), dtype=np.int64)
    return _RAMP[0]


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) index of the sequence each packed token belongs to."""
    lengths = cu_seqlens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, T, T) additive mask: 0 where query i may see key j (same sequence, j <= i), else -inf-ish.

    Additive float (not bool) because eager attention adds the mask to the scores while sdpa
    accepts either; finfo.min rather than -inf keeps softmax NaN-free.
    """
    seg_T = segment_ids(cu_seqlens)
    T = seg_T.numel()
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=seg_T.device).tril()
    allowed_TT = causal_TT & (seg_T[:, None] == seg_T[None, :])
    mask_TT = torch.zeros(T, T, dtype=dtype, device=seg_T.device)
    return mask_TT.masked_fill(~allowed_TT, torch.finfo(dtype).min)[None, None]


def unpack(values_T: torch.Tensor, cu_seqlens: torch.Tensor, drop_last: bool = True) -> list[torch.Tensor]:
    """Split packed per-token values back per sequence (dropping each sequence's last position,
    whose 'next token' belongs to the following sequence, when drop_last)."""
    bounds = cu_seqlens.tolist()
    cut = 1 if drop_last else 0
    return [values_T[a : b - cut] for a, b in zip(bounds[:-1], bounds[1:])]


# --------------------------------------------------------------------------------------------
# the model forward
# --------------------------------------------------------------------------------------------


VARLEN_IMPL = "packed_sdpa"  # our per-sequence attention, registered with transformers on demand


def flash_attn_available() -> bool:
    """True when transformers would run ``flash_attention_2``: its own test,
    ``transformers.utils.is_flash_attn_2_available()`` (the ``flash-attn`` distribution >= 2.3.3 and a
    CUDA torch). Not ``find_spec("flash_attn")``: flash-attn-4 (an sglang 0.5.x dependency) installs only
    the namespace ``flash_attn/cute``, which ``find_spec`` finds, and loading a model with
    ``flash_attention_2`` then raises ImportError."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


BUCKET_RATIO = 0.75  # a length bucket holds sequences of >= 0.75 x its longest: <= 1.8x attention work


@dataclass
class _Bucket:
    """Sequences padded to one length L: ``gather_NL`` indexes the packed tokens (padding repeats
    a real token), ``real`` selects the real (sequence, position) cells of the flattened N x L;
    ``mask`` (N, 1, L, L), with a shared prefix's branches: who attends to whom (None: causal)."""

    gather_NL: torch.Tensor
    real: torch.Tensor
    mask: Optional[torch.Tensor] = None


@dataclass
class _VarlenPlan:
    buckets: list[_Bucket]
    inverse_T: torch.Tensor  # packed position of each token in the buckets' concatenated order


_plan_cache: dict = {}


def varlen_plan(cu: torch.Tensor, ratio: float = BUCKET_RATIO, branch_T: Optional[torch.Tensor] = None) -> _VarlenPlan:
    """Group packed sequences into buckets of similar length (one sdpa call each).

    Sequences are sorted by length, longest first; a bucket takes sequences while they are at
    least ``ratio`` x its first (longest) one. Right padding needs no mask under causal
    attention: a real query only sees keys at or before it, all real; padded rows are dropped.
    ``branch_T`` (a ``shared_prefix.SharedPrefix``'s): each bucket gets its branch mask.
    """
    lengths = cu.diff().long()
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_len = lengths[order].tolist()
    starts, device = cu[:-1].long(), cu.device
    buckets, firsts, i = [], [], 0
    while i < len(sorted_len):
        j = i
        while j < len(sorted_len) and sorted_len[j] >= ratio * sorted_len[i]:
            j += 1
        seqs, L = order[i:j], sorted_len[i]
        pos_L = torch.arange(L, device=device)
        valid_NL = pos_L[None, :] < lengths[seqs][:, None]
        gather_NL = starts[seqs][:, None] + torch.minimum(pos_L[None, :], lengths[seqs][:, None] - 1)
        mask = None if branch_T is None else branch_mask(branch_T[gather_NL])
        buckets.append(_Bucket(gather_NL, valid_NL.reshape(-1).nonzero().squeeze(1), mask))
        firsts.append(gather_NL.reshape(-1)[buckets[-1].real])
        i = j
    order_T = torch.cat(firsts)
    inverse_T = torch.empty_like(order_T)
    inverse_T[order_T] = torch.arange(order_T.numel(), device=device)
    return _VarlenPlan(buckets, inverse_T)


def _cached_plan(cu: torch.Tensor) -> _VarlenPlan:
    """One plan per forward: every layer gets the same ``cu`` tensor object."""
    key = id(cu)
    hit = _plan_cache.get("plan")
    if hit is not None and hit[0] == key and hit[1] is cu:
        return hit[2]
    plan = varlen_plan(cu)
    _plan_cache["plan"] = (key, cu, plan)
    return plan


def _varlen_sdpa_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs
):
    """Attention within each packed sequence, a few batched causal sdpa calls (one per length bucket).

    query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), as transformers expects.
    Work O(sum L_i^2) up to the bucket padding (``BUCKET_RATIO``), no (T, T) mask, and the number
    of kernel calls grows with the spread of lengths (log), not with the number of sequences.
    Measured on this 2-core machine (hidden 64, 1 thread, forward + backward, busy machine so
    ratios only): 256 sequences of 6-8 tokens: a loop of one sdpa per sequence 2282 ms, one sdpa
    with the dense block mask 2466 ms, buckets 504 ms; 64 of 20-200 tokens: 3635 / 15550 / 1789 ms;
    16 of 6-8 tokens (T = 110, where a dense mask is cheapest): 64 / 52 / 40 ms.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(
            f"attn_implementation={VARLEN_IMPL!r} serves packed forwards only (got no "
            "cu_seq_lens_q); use 'sdpa' for generation or padded batches"
        )
    from transformers.integrations.sdpa_attention import repeat_kv  # transformers is loaded by now

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    plan = _cached_plan(cu)
    p = dropout if module.training else 0.0
    q_THD, k_THD, v_THD = (x[0].transpose(0, 1) for x in (query, key, value))
    outs = []
    for b in plan.buckets:
        q, k, v = (x[b.gather_NL].transpose(1, 2) for x in (q_THD, k_THD, v_THD))  # (N, H, L, D)
        o_NLHD = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling).transpose(1, 2)
        outs.append(o_NLHD.reshape(-1, *o_NLHD.shape[2:])[b.real])
    return torch.cat(outs)[plan.inverse_T][None].contiguous(), None


def register_varlen_attention() -> str:
    """Make ``attn_implementation='packed_sdpa'`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPL, _varlen_sdpa_forward)
    return VARLEN_IMPL


def use_varlen_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded model to per-sequence packed attention (training only: it refuses
    unpacked forwards such as ``generate``)."""
    model.set_attn_implementation(register_varlen_attention())
    return model


def select_attn_implementation(device: str | torch.device, dtype: torch.dtype = torch.float32) -> str:
    """What to pass as ``attn_implementation`` when loading a model for packed training:
    flash-attn varlen on CUDA when installed and the compute dtype is bf16/fp16 (flash-attn
    refuses float32), else our per-sequence sdpa (registered here)."""
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and flash_attn_available():
        return "flash_attention_2"
    return register_varlen_attention()


def _attention_kwargs(model: torch.nn.Module, packed: PackedBatch, dtype: torch.dtype) -> dict:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl in _FLASH_IMPLS or impl == VARLEN_IMPL:
        cu, most = packed.attention_cu.to(torch.int32), packed.attention_max
        return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=most, max_length_k=most)
    if impl in _MASK_IMPLS:
        return dict(attention_mask=block_causal_mask(packed.attention_cu, dtype))
    raise ValueError(
        f"attn_implementation={impl!r} is not supported by packing; expected one of "
        f"{_MASK_IMPLS + _FLASH_IMPLS + (VARLEN_IMPL,)}"
    )


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _logits(model: torch.nn.Module, packed: PackedBatch, lean: bool) -> torch.Tensor:
    """(T, V) logits of a packed batch (on the model's device)."""
    if _lean(model, lean):
        return module_linear(model.lm_head, _hidden(model, packed, lean))
    kwargs = _attention_kwargs(model, packed, _model_dtype(model))
    out = model(input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **kwargs)
    return out.logits[0]


def runs_lean(model: torch.nn.Module) -> bool:
    """Whether ``forward_packed`` (lean=True) runs this model on the lean forward (where ``PackedBatch.shared``
    applies): the 'packed_sdpa' attention and a model ``lean_forward`` computes."""
    return _lean(model, True)


def _lean(model: torch.nn.Module, lean: bool) -> bool:
    impl = getattr(model.config, "_attn_implementation", None)
    return lean and impl == VARLEN_IMPL and lean_forward.supports(model)


PLAIN_HEAD_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # logits = lm_head(final norm's output), nothing after


def _head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The lm head when the chunked head can replace it (``chunked_head``'s docstring): a plain
    ``nn.Linear`` of a model whose logits are exactly its output; else None. FSDP-sharded models
    too: ``_through_root`` calls it inside the root's forward, where its weight is gathered."""
    head = getattr(model, "lm_head", None)
    cfg = getattr(model, "config", None)
    if type(head) is not torch.nn.Linear or getattr(cfg, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    return head if hasattr(model, "model") else None


def _through_root(model: torch.nn.Module, head: torch.nn.Linear, packed: PackedBatch, fused) -> tuple:
    """``fused(h_TE, weight, bias)`` on the head's input, called inside the FSDP2 root's forward.

    Under ``fully_shard`` the head (and the embedding tied to it) belong to the root unit: the
    root's forward pre-hook gathers them and its hooks reduce-scatter their gradients after
    backward. Taking the hidden states from ``model.model`` would skip both (a sharded DTensor
    weight, gradients never reduced), so the whole model runs as usual and, for this one call,
    the head's ``forward`` is replaced by the fused head (HF's causal LMs end with
    ``logits = self.lm_head(hidden_states)``, transformers 5.x ``Qwen2ForCausalLM.forward``).
    Its results leave as the model's output ((1, T, 2): logp, entropy), so FSDP's hooks on the
    output see the graph as they see the logits'."""
    results = {}

    def fused_forward(h_1TE: torch.Tensor) -> torch.Tensor:
        logp_T, ent_T = fused(h_1TE[0], head.weight, head.bias)
        results["has_entropy"] = ent_T is not None
        ent_T = logp_T.detach() * 0 if ent_T is None else ent_T
        return torch.stack([logp_T[None], ent_T[None]], -1)  # (1, T, 2), not a view

    head.forward = fused_forward
    try:
        kwargs = _attention_kwargs(model, packed, _model_dtype(model))
        out = model(input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **kwargs)
    finally:
        del head.forward  # the class's forward again
    both_T2 = out.logits[0]
    return both_T2[:, 0], both_T2[:, 1] if results["has_entropy"] else None


def _hidden(
    model: torch.nn.Module, packed: PackedBatch, lean: bool, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(T, E) hidden states entering the lm head (HF's base model, or the lean forward); ``rows``: those
    positions' only. A ``packed.shared`` layout is what the lean forward runs (HF's forward runs the sequences)."""
    sh = packed.shared if _lean(model, lean) else None
    if sh is not None:
        h_PE = lean_forward.lean_hidden(model, sh.ids_P, sh.pos_P, varlen_plan(sh.cu_P, branch_T=sh.branch_P))
        return h_PE.index_select(0, sh.rows_T if rows is None else sh.rows_T.index_select(0, rows))
    h_TE = _hidden_of_sequences(model, packed, lean)
    return h_TE if rows is None else h_TE.index_select(0, rows)


def _hidden_of_sequences(model: torch.nn.Module, packed: PackedBatch, lean: bool) -> torch.Tensor:
    if _lean(model, lean):
        return lean_forward.lean_hidden(model, packed.ids_T, packed.position_ids_T, varlen_plan(packed.attention_cu))
    kwargs = _attention_kwargs(model, packed, _model_dtype(model))
    out = model.model(input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **kwargs)
    return out.last_hidden_state[0]


def forward_packed(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    lean: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    whole_max_bytes: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logp_T, entropy_T or None) for every packed position; position t scores token t+1.

    lean: with the 'packed_sdpa' attention, compute Llama/Qwen2 logits with ``lean_forward``
    (the same arithmetic without HF's forward; other models always take HF's forward).

    chunk_tokens: a micro-batch of more tokens than this goes through ``chunked_head`` (the lm
    head and log-softmax ``chunk_tokens`` tokens at a time: no (T, V) tensor), when the model's head
    allows it (``_head``); 0, a smaller micro-batch or another head: the whole (T, V) logits.
    whole_max_bytes > 0: chunk only when the whole float32 logits would be larger than that
    (``use_chunked_head``): below it the chunked head's one more head matmul in backward buys nothing.

    entropy_grad=False computes the entropy as a statistic only (no (T, V) softmax kept for
    backward). ``packed.scored_T`` (set by the trainer): the head runs on those positions only
    (``_scored_logprobs``), every other position's values are 0.
    The last position of each sequence scores the next sequence's first token: meaningless,
    dropped by ``unpack``. Logits are taken in float32 whatever the model dtype.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: expected > 0")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected >= 0 (0: whole logits)")
    device = next(model.parameters()).device
    packed = packed.to(device)
    next_T = torch.roll(packed.ids_T, -1)
    if packed.scored_T is not None and _head(model) is not None and not lean_forward._is_fsdp(model):
        return _scored_logprobs(model, packed, next_T, temperature, with_entropy, entropy_grad, lean, chunk_tokens,
                                whole_max_bytes)  # fmt: skip
    T = packed.ids_T.numel()
    head = _head(model) if 0 < chunk_tokens < T else None
    if head is not None and not use_chunked_head(T, head.weight.shape[0], chunk_tokens, whole_max_bytes):
        head = None
    if head is not None:

        def fused(h_TE, w, b):
            return head_logprobs(h_TE, w, b, next_T, temperature, chunk_tokens, with_entropy, entropy_grad)

        if lean_forward._is_fsdp(model):
            return _through_root(model, head, packed, fused)
        return fused(_hidden(model, packed, lean), head.weight, head.bias)
    return _whole_logprobs(_logits(model, packed, lean), next_T, temperature, with_entropy, entropy_grad)


def _scored_logprobs(model, packed: PackedBatch, next_T, temperature, with_entropy, entropy_grad, lean, chunk_tokens,
                     whole_max_bytes) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """``forward_packed`` with the lm head on ``packed.scored_T`` only (a plain head, not FSDP-sharded): the
    hidden states of every position, those rows selected, the head (chunked or whole, chosen by their count), then
    scattered into (T,) zeros. The same values at the scored positions (the rows a head computes are independent);
    a prompt of P tokens and an output of O costs the head O rows instead of P + O."""
    head = _head(model)
    S, T = packed.scored_T, packed.ids_T.numel()
    h_SE, next_S = _hidden(model, packed, lean, rows=S), next_T.index_select(0, S)
    n = S.numel()
    if 0 < chunk_tokens < n and use_chunked_head(n, head.weight.shape[0], chunk_tokens, whole_max_bytes):
        logp_S, ent_S = head_logprobs(h_SE, head.weight, head.bias, next_S, temperature, chunk_tokens, with_entropy,
                                      entropy_grad)  # fmt: skip
    else:
        logits_SV = module_linear(head, h_SE)  # the head module's F.linear (or oneDNN's: actor.linears)
        logp_S, ent_S = _whole_logprobs(logits_SV, next_S, temperature, with_entropy, entropy_grad)

    def spread(v_S: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if v_S is None else v_S.new_zeros(T).index_copy(0, S, v_S)

    return spread(logp_S), spread(ent_S)


def use_chunked_head(tokens: int, vocab: int, chunk_tokens: int, whole_max_bytes: int = 0) -> bool:
    """Whether ``forward_packed`` runs the lm head in chunks: ``chunk_tokens`` > 0, more tokens than one
    chunk, and (with ``whole_max_bytes`` > 0) whole float32 logits (tokens x vocab x 4 bytes) above it."""
    if not 0 < chunk_tokens < tokens:
        return False
    return whole_max_bytes <= 0 or tokens * vocab * 4 > whole_max_bytes


def _whole_logprobs(logits_TV, next_T, temperature: float, with_entropy: bool, entropy_grad: bool):
    logits_TV = logits_TV.float()
    if temperature != 1.0:
        logits_TV = logits_TV / temperature
    if not (with_entropy and entropy_grad and torch.is_grad_enabled()):  # the entropy, if any, a statistic
        return whole_logprobs(logits_TV, next_T, with_entropy)
    # gather - logsumexp instead of log_softmax: no second (T, V) tensor for the whole vocab
    lse_T = torch.logsumexp(logits_TV, dim=-1)
    logp_T = logits_TV.gather(-1, next_T[:, None])[:, 0] - lse_T
    entropy_T = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            probs_TV = F.softmax(logits_TV, dim=-1)
            entropy_T = lse_T - (probs_TV * logits_TV).sum(-1)
    return logp_T, entropy_T
