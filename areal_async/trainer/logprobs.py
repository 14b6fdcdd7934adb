"""Per-sequence logprobs computed with packing and micro-batches.

Covered: ``packed_logprobs`` (proximal / reference logprob recomputation, or with grad for a
loss) and ``iter_micro_batches`` (the packed micro-batches the actor and SFT loops run one at a
time for gradient accumulation). Not covered: the loss itself (``loss.py``), distributed data
parallelism (the caller shards sequences across ranks first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from areal_async.trainer.packing import Seq, allocate_micro_batches, forward_packed, pack, seq_len, unpack


@dataclass
class MicroBatchOut:
    """The forward result of one micro-batch: ``indices`` into the caller's sequence list, and
    per sequence the logprobs (and entropies) of tokens 1..L-1 given their prefixes."""

    indices: list[int]
    logp: list[torch.Tensor]
    entropy: Optional[list[torch.Tensor]]


def iter_micro_batches(
    model: torch.nn.Module,
    seqs: Sequence[Seq],
    temperature: float,
    max_tokens_per_mb: int,
    oversize: str = "error",
    with_entropy: bool = False,
    entropy_grad: bool = True,
    allocation: Optional[list[list[int]]] = None,
) -> Iterator[MicroBatchOut]:
    """Run the model on balanced packed micro-batches, yielding each before computing the next,
    so a caller can backward and free one micro-batch's graph at a time.

    ``allocation``: the micro-batches (lists of indices into ``seqs``) when the caller planned
    them (data-parallel ranks plan theirs together); default: allocated here under the budget."""
    if allocation is None:
        allocation = allocate_micro_batches([seq_len(s) for s in seqs], max_tokens_per_mb, oversize)
    for indices in allocation:
        packed = pack([seqs[i] for i in indices])
        logp_T, entropy_T = forward_packed(model, packed, temperature, with_entropy, entropy_grad)
        cu = packed.cu_seqlens
        ent = unpack(entropy_T, cu) if entropy_T is not None else None
        yield MicroBatchOut(indices, unpack(logp_T, cu), ent)


def packed_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[Seq],
    temperature: float,
    max_tokens_per_mb: int,
    oversize: str = "error",
) -> list[torch.Tensor]:
    """Logprob of token t+1 given tokens <= t for each sequence (length L-1 each), in input order.

    Gradient flows when grad mode is on; wrap in ``torch.no_grad()`` for recomputation.
    """
    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    for mb in iter_micro_batches(model, seqs, temperature, max_tokens_per_mb, oversize):
        for i, lp in zip(mb.indices, mb.logp):
            out[i] = lp
    assert all(o is not None for o in out), "allocator dropped a sequence"
    return out  # type: ignore[return-value]
