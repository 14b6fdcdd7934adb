"""One trajectory batch: the samples of one or more groups, in the one layout rollout and trainer share.

A rollout worker builds a ``TrajectoryBatch`` (one group: ``TrajectoryBatch.group``; the groups one
engine step finished: ``TrajectoryBatch.join``) and sends ``channel.send(*batch.encode())``; the
trainer turns what it receives back into one (``TrajectoryBatch.decode(*channel.recv())``) and
into per-sample views (``samples()``: views of the message's tensors, no copy, no per-token
Python). A single group is the one-group case of the one layout::

    meta (protocols.side.TrajectoryMeta), msgpack lists:
        group_ids[G], group_sizes[G], prompt_lengths[G]   group j: the next group_sizes[j] samples
        sample_ids[N], lengths[N]                         sample i: lengths[i] output tokens
        segment_starts[N] (optional)                      sample i's output offsets where a new sequence
                                                          starts (an agent's segments: trained apart)
    tensors, each 1D:
        prompt_ids   int32   (sum of prompt_lengths)  each group's prompt once, end to end
        output_ids   int32   (sum of lengths)         the samples' outputs end to end
        logprobs     float32 (sum of lengths)         behaviour logprob of each output token
        versions     int32   (sum of lengths)         policy version of each output token
        loss_mask    int8    (sum of lengths)         optional (a workflow's episodes): 1 trained, 0 not

The counts travel in the meta, not as tensors: a message of a few small groups pays for a frame
per tensor on both sides (about 5 us each here), and the receiver needs them as Python ints anyway.
``decode`` checks all of it (the meta's fields and their consistency, the tensors' names, dtypes and
ranks, every tensor's length against the counts) and raises ``ProtocolError`` naming the first
mismatch before any view is made; ``encode`` runs the same checks, so a sender's mistake fails
where it is made.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from protocols.messages import ProtocolError, build
from protocols.side import TrajectoryMeta, trajectory_counts_problem

WIRE_DTYPES: dict[str, torch.dtype] = {
    "prompt_ids": torch.int32,
    "output_ids": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "loss_mask": torch.int8,  # optional
}
_REQUIRED = frozenset(WIRE_DTYPES) - {"loss_mask"}


@dataclass(slots=True)
class SampleView:
    """One sample of a ``TrajectoryBatch``: its ids and views of the batch's tensors (wire dtypes)."""

    sample_id: str
    group_id: str
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    segment_starts: Optional[list[int]] = None  # output offsets where a new sequence starts (None: one sequence)


@dataclass
class TrajectoryBatch:
    """The samples of ``group_ids`` in the layout of the module docstring (tensors in their wire dtypes)."""

    group_ids: list[str]
    group_sizes: list[int]
    prompt_lengths: list[int]
    sample_ids: list[str]
    lengths: list[int]
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    segment_starts: Optional[list[list[int]]] = None  # one list a sample (an agent's segments); None: none

    # ---- building --------------------------------------------------------------------------
    @classmethod
    def group(
        cls,
        group_id: str,
        sample_ids: Sequence[str],
        prompt_ids,
        lengths: Sequence[int],
        output_ids,
        logprobs,
        versions,
        loss_mask=None,
        segment_starts: Optional[list[list[int]]] = None,
    ) -> "TrajectoryBatch":
        """One group: its prompt once, its samples' outputs end to end (``lengths[i]`` tokens of sample i).
        Tensors or lists; converted to the wire dtypes (a tensor already in its dtype is kept as is)."""
        prompt = _wire(prompt_ids, "prompt_ids")
        return cls(
            group_ids=[group_id],
            group_sizes=[len(sample_ids)],
            prompt_lengths=[prompt.numel()],
            sample_ids=list(sample_ids),
            lengths=[int(n) for n in lengths],
            prompt_ids=prompt,
            output_ids=_wire(output_ids, "output_ids"),
            logprobs=_wire(logprobs, "logprobs"),
            versions=_wire(versions, "versions"),
            loss_mask=None if loss_mask is None else _wire(loss_mask, "loss_mask"),
            segment_starts=_segments(segment_starts),
        )

    @classmethod
    def join(cls, batches: Sequence["TrajectoryBatch"]) -> "TrajectoryBatch":
        """Several batches as one, in order (one batch: itself). With a loss mask on all or on none."""
        if not batches:
            raise ValueError("TrajectoryBatch.join got no batches; expected at least one")
        if len(batches) == 1:
            return batches[0]
        if len({b.loss_mask is None for b in batches}) > 1:
            raise ValueError(
                "TrajectoryBatch.join: some batches carry a loss mask and some do not; expected all or none"
            )
        lists = {f: [x for b in batches for x in getattr(b, f)] for f in _META_FIELDS}
        tensors = {f: torch.cat([getattr(b, f) for b in batches]) for f in _REQUIRED}
        mask = None if batches[0].loss_mask is None else torch.cat([b.loss_mask for b in batches])
        segs = None
        if any(b.segment_starts for b in batches):
            segs = [list(x) for b in batches for x in (b.segment_starts or [[]] * len(b.sample_ids))]
        return cls(**lists, **tensors, loss_mask=mask, segment_starts=segs)

    @classmethod
    def of_samples(cls, samples: Sequence[SampleView]) -> "TrajectoryBatch":
        """Views back into one batch (a copy): consecutive samples of one group id share its group (and
        the first one's prompt); with a loss mask on all samples or on none."""
        runs = [list(run) for _, run in itertools.groupby(samples, key=lambda s: s.group_id)]
        return cls.join(
            [
                cls.group(
                    run[0].group_id,
                    [s.sample_id for s in run],
                    run[0].prompt_ids,
                    [s.output_ids.numel() for s in run],
                    *(_cat([getattr(s, name) for s in run]) for name in ("output_ids", "logprobs", "versions")),
                    loss_mask=None if run[0].loss_mask is None else _cat([s.loss_mask for s in run]),
                    segment_starts=[list(s.segment_starts or []) for s in run],
                )
                for run in runs
            ]
        )

    # ---- the wire --------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """The message's key on a tensor channel: its first group id."""
        return self.group_ids[0]

    @property
    def nbytes(self) -> int:
        """Payload bytes: the tensors', and 4 a count in the meta (as if they were int32 tensors)."""
        counts = 4 * (len(self.group_ids) + len(self.sample_ids))
        return counts + sum(t.numel() * t.element_size() for t in self.tensors().values())

    def meta(self) -> dict:
        out = {f: getattr(self, f) for f in _META_FIELDS}
        if self.segment_starts:
            out["segment_starts"] = self.segment_starts
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors of the layout (``loss_mask`` only when there is one)."""
        out = {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids}
        out.update(logprobs=self.logprobs, versions=self.versions)
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        return out

    def encode(self) -> tuple[str, dict[str, torch.Tensor], dict]:
        """(key, tensors, meta): the arguments of ``TensorChannel.send``, checked first (the counts'
        consistency and the tensors against them; the meta's field types are the receiver's check)."""
        where = f"trajectory message {self.group_ids[0] if self.group_ids else '(no group)'!r}"
        meta = self.meta()
        why = trajectory_counts_problem(self)
        if why:
            raise ProtocolError(f"{where}: trajectory_meta: {why}")
        self._check_tensors(where)
        return self.key, self.tensors(), meta

    @classmethod
    def decode(cls, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> "TrajectoryBatch":
        """``TensorChannel.recv``'s (key, meta, tensors) -> the batch, every field checked
        (``ProtocolError`` naming the first mismatch)."""
        where = f"trajectory message {key!r}"
        m = _meta(where, meta)
        names = set(tensors) if isinstance(tensors, dict) else set()
        if not _REQUIRED <= names <= set(WIRE_DTYPES):
            raise ProtocolError(
                f"{where}: tensors {sorted(names)}; expected {sorted(_REQUIRED)} and optionally 'loss_mask'"
            )
        batch = cls(m.group_ids, m.group_sizes, m.prompt_lengths, m.sample_ids, m.lengths, **tensors)
        batch.segment_starts = _segments(m.segment_starts)
        batch._check_tensors(where)
        return batch

    def _check_tensors(self, where: str) -> None:
        """Every tensor 1D of its wire dtype and as long as the counts say."""
        n = sum(self.lengths)
        for name, dtype in WIRE_DTYPES.items():
            t = getattr(self, name)
            if t is None and name == "loss_mask":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ProtocolError(f"{where}: {name} is {got}; expected a 1D {dtype} tensor")
            if name == "prompt_ids":
                _count(where, name, t.numel(), "the prompt lengths' sum", sum(self.prompt_lengths))
            else:
                _count(where, name, t.numel(), "the output lengths' sum", n)

    # ---- reading ---------------------------------------------------------------------------
    def samples(self) -> list[SampleView]:
        """One view per sample, in order (views of this batch's tensors: no copy)."""
        lengths, sizes = self.lengths, self.group_sizes
        prompts = [self.prompt_ids] if len(sizes) == 1 else self.prompt_ids.split_with_sizes(self.prompt_lengths)
        gids = [g for g, n in zip(self.group_ids, sizes) for _ in range(n)]
        prompt_of = [p for p, n in zip(prompts, sizes) for _ in range(n)]
        split = (t.split_with_sizes(lengths) for t in (self.output_ids, self.logprobs, self.versions))
        masks = itertools.repeat(None) if self.loss_mask is None else self.loss_mask.split_with_sizes(lengths)
        segs = itertools.repeat(None) if not self.segment_starts else [s or None for s in self.segment_starts]
        return list(map(SampleView, self.sample_ids, gids, prompt_of, *split, masks, segs))


_META_FIELDS = ("group_ids", "group_sizes", "prompt_lengths", "sample_ids", "lengths")


def _meta(where: str, meta) -> TrajectoryMeta:
    try:
        return build(TrajectoryMeta, meta)
    except ProtocolError as e:
        raise ProtocolError(f"{where}: {e}") from None


def _wire(x, name: str) -> torch.Tensor:
    """``x`` as a 1D tensor of the wire dtype of ``name`` (kept as is when it already is one)."""
    dtype = WIRE_DTYPES[name]
    if isinstance(x, torch.Tensor):
        return x if x.dtype == dtype else x.to(dtype)
    return torch.tensor(list(x), dtype=dtype)


def _segments(segs) -> Optional[list[list[int]]]:
    """Per-sample segment starts, or None when no sample has any (the layout without them)."""
    return [list(s) for s in segs] if segs and any(segs) else None


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _count(where: str, name: str, have: int, what: str, want: int) -> None:
    if have != want:  # (the message is built only when it is wrong)
        raise ProtocolError(f"{where}: {name} has {have} entries; expected {want} ({what})")
