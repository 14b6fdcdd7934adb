"""Per-sequence logprobs computed with packing and micro-batches.

Covered: ``packed_logprobs`` (proximal / reference logprob recomputation, or with grad for a
loss) and ``iter_micro_batches`` (the packed micro-batches the actor and SFT loops run one at a
time for gradient accumulation). Not covered: the loss itself (``algo/loss.py``), distributed data
parallelism (the caller shards sequences across ranks first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from areal_async.trainer.compute.chunked_head import DEFAULT_CHUNK_TOKENS
from areal_async.trainer.compute.packing import PackedBatch, Seq, forward_packed, pack, seq_len, unpack
from areal_async.trainer.compute.micro_batches import allocate_micro_batches


@dataclass
class MicroBatchOut:
    """The forward result of one micro-batch: ``indices`` into the caller's sequence list, and
    the packed per-position logprobs (and entropies) with the packing's ``cu_seqlens``: position
    t of sequence j scores its token t+1."""

    indices: list[int]
    logp_T: torch.Tensor
    entropy_T: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor

    @property
    def logp(self) -> list[torch.Tensor]:
        """Per sequence, the logprobs of tokens 1..L-1 given their prefixes."""
        return unpack(self.logp_T, self.cu_seqlens)

    @property
    def entropy(self) -> Optional[list[torch.Tensor]]:
        return None if self.entropy_T is None else unpack(self.entropy_T, self.cu_seqlens)

    def tails(self, starts: Sequence[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sequence j's values from its position ``starts[j]`` to its last scored one (L_j - 2),
        all sequences concatenated in order: one gather, not a slice per sequence. With
        ``starts[j]`` = prompt length - 1 these are the logprobs (entropies) of the output tokens."""
        idx = tail_index(self.cu_seqlens, starts).to(self.logp_T.device)
        ent = None if self.entropy_T is None else self.entropy_T.index_select(0, idx)
        return self.logp_T.index_select(0, idx), ent


def tail_index(cu_seqlens: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """Packed positions cu[j] + starts[j] .. cu[j+1] - 2 for every sequence j, in order (int64)."""
    cu = cu_seqlens.cpu().numpy().astype(np.int64)
    first = cu[:-1] + np.asarray(starts, dtype=np.int64)
    counts = cu[1:] - 1 - first
    if (counts < 0).any():
        j = int(np.flatnonzero(counts < 0)[0])
        raise ValueError(f"sequence {j}: start {starts[j]} is past its last scored position {cu[j + 1] - cu[j] - 2}")
    return torch.from_numpy(ranges(first, counts))


def ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[j] .. first[j] + counts[j] - 1 for every j, concatenated (int64, no Python loop)."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(first - (ends - counts), counts)


def iter_micro_batches(
    model: torch.nn.Module,
    seqs: Sequence[Seq],
    temperature: float,
    max_tokens_per_mb: int,
    oversize: str = "error",
    with_entropy: bool = False,
    entropy_grad: bool = True,
    allocation: Optional[list[list[int]]] = None,
    packer: Optional[Callable[[list[int]], PackedBatch]] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    whole_max_bytes: int = 0,
) -> Iterator[MicroBatchOut]:
    """Run the model on balanced packed micro-batches, yielding each before computing the next,
    so a caller can backward and free one micro-batch's graph at a time.

    ``allocation``: the micro-batches (lists of indices into ``seqs``) when the caller planned
    them (data-parallel ranks plan theirs together); default: allocated here under the budget.
    ``packer``: indices -> their ``pack``ed sequences, when the caller keeps packed micro-batches
    (the actor packs once for the proximal recompute and the update); default ``pack``.
    ``chunk_tokens``, ``whole_max_bytes``: ``forward_packed``'s (the lm head in chunks of that many tokens when
    the whole logits would exceed that many bytes; 0: whole logits / chunked whenever longer than a chunk)."""
    if allocation is None:
        allocation = allocate_micro_batches([seq_len(s) for s in seqs], max_tokens_per_mb, oversize)
    for indices in allocation:
        packed = packer(indices) if packer is not None else pack([seqs[i] for i in indices])
        logp_T, entropy_T = forward_packed(
            model,
            packed,
            temperature,
            with_entropy,
            entropy_grad,
            chunk_tokens=chunk_tokens,
            whole_max_bytes=whole_max_bytes,
        )
        yield MicroBatchOut(indices, logp_T, entropy_T, packed.cu_seqlens)


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
