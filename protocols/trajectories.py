"""The one trajectory type: ``TrajectoryBatch`` (columns) and its row ``Trajectory`` (one sample).

A rollout worker builds a ``TrajectoryBatch`` (one group: ``TrajectoryBatch.group``; the groups one
engine step finished: ``TrajectoryBatch.join``) and sends ``channel.send(*batch.encode())``; the
trainer turns what it receives back into one (``TrajectoryBatch.decode(*channel.recv())``) and
into its rows (``samples()``: ``Trajectory`` objects whose tensors are views of the message's, no
copy, no per-token Python); the trainer's rank broadcast sends a step's rows as
``TrajectoryBatch.of_samples(rows).encode()`` (``trainer/compute/dp.py``), and the step's recording is the
same encode in a file (``trainer/persist/recording.py``). A single group is the one-group case::

    meta (protocols.side.TrajectoryMeta), msgpack lists:
        group_ids[G], group_sizes[G], prompt_lengths[G]   group j: the next group_sizes[j] samples
        sample_ids[N], lengths[N]                         sample i: lengths[i] output tokens
        segment_starts[N] (optional)                      sample i's output offsets where a new sequence
                                                          starts (an agent's segments: trained apart)
    tensors, each 1D, one dtype a field from the engine to the trainer:
        prompt_ids   int32   (sum of prompt_lengths)  each group's prompt once, end to end
        output_ids   int32   (sum of lengths)         the samples' outputs end to end
        logprobs     float32 (sum of lengths)         behaviour logprob of each output token
        versions     int32   (sum of lengths)         policy version of each output token
        loss_mask    bool    (sum of lengths)         optional (a workflow's episodes): True trained
        score        float64 (N)                      optional (the trainer's step: each sample's score)
        entropy      float32 (sum of lengths)         optional (rollout.token_entropy): the engine's, per token

The columns are declared once, as the fields of ``Trajectory`` made with ``column`` (``COLUMNS``):
a new per-token field is one ``column`` field there; the batch's building, joining, encoding,
decoding, checking and splitting into rows all follow from it.

The counts travel in the meta, not as tensors: a message of a few small groups pays for a frame
per tensor on both sides (about 5 us each here), and the receiver needs them as Python ints anyway.
``decode`` checks all of it (the meta's fields and their consistency, the tensors' names, dtypes and
ranks, every tensor's length against the counts) and raises ``ProtocolError`` naming the first
mismatch before any view is made; ``encode`` runs the same checks, so a sender's mistake fails
where it is made.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

from protocols.messages import ProtocolError, build
from protocols.side import TrajectoryMeta, trajectory_counts_problem

TOKEN, PROMPT, SAMPLE = "token", "prompt", "sample"  # what a column has one entry of


def column(dtype: torch.dtype, per: str = TOKEN, *, optional: bool = False, fill: float = 0):
    """A field of ``Trajectory`` that is a column of ``TrajectoryBatch``: its one dtype, what it has
    one entry of, and (``optional``) the value a row without it contributes when others have it."""
    meta = {"dtype": dtype, "per": per, "optional": optional, "fill": fill}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


@dataclass(frozen=True)
class Segmented:
    """One sequence (its ``parts`` laid end to end, as a tuple sequence) whose attention and positions restart
    at the offsets ``breaks``: an agent's turns after template drift, each segment trained on exactly the
    context it was sampled from, while the sequence keeps one entry in ``cu_seqlens`` (so per-sequence
    results, ``unpack``, stay one a trajectory). The last position of a segment scores the next segment's
    first token from the wrong context: that token is its segment's prompt (loss mask 0), never trained."""

    parts: tuple
    breaks: tuple[int, ...]


@dataclass(slots=True, eq=False)
class Trajectory:
    """One sample: prompt + generated output, its per-token fields 1D tensors of their column's dtype.

    A row of a ``TrajectoryBatch`` (``samples()``) holds views of the batch's tensors; built by hand,
    lists and other dtypes are converted once and the fields are checked (``ValueError`` naming
    the first bad one)."""

    sample_id: str
    group_id: str  # the n samples of one prompt share it
    prompt_ids: torch.Tensor = column(torch.int32, PROMPT)
    output_ids: torch.Tensor = column(torch.int32)
    # behaviour logprob of each output token: log_softmax(logits / temperature)[token], before top-p
    logprobs: torch.Tensor = column(torch.float32)
    versions: torch.Tensor = column(torch.int32)  # policy version of the weights that produced each token
    score: float = column(torch.float64, SAMPLE, optional=True, fill=math.nan)  # task score, NaN: unknown
    # per output token: True = trained, False = not (a workflow's environment or tool tokens); None = all trained
    loss_mask: Optional[torch.Tensor] = column(torch.bool, optional=True, fill=1)
    # output offsets where a new sequence starts (an agent's turns after template drift): the trainer restarts
    # positions and attention there (``seq_parts``); None = one sequence
    segment_starts: Optional[list[int]] = None
    finish_reason: Optional[str] = None  # the engine's: "stop" | "length" | "abort" (not on the wire)
    # per output token: the entropy (nats) of the distribution it was sampled from (rollout.token_entropy)
    entropy: Optional[torch.Tensor] = column(torch.float32, optional=True, fill=math.nan)

    def __post_init__(self) -> None:
        self.score = math.nan if self.score is None else float(self.score)
        self._convert()
        self._check()

    def _convert(self) -> None:
        """Lists and other dtypes to their column's (a tensor of it is kept as it is)."""
        for name, dtype in TENSOR_COLUMNS.items():
            x = getattr(self, name)
            if x is not None and not (isinstance(x, torch.Tensor) and x.dtype == dtype and x.dim() == 1):
                setattr(self, name, as_column(x, name))

    def _check(self) -> None:
        """``ValueError`` naming the first bad field (one call a row a step: no message is built unless)."""
        n, why = self.output_ids.numel(), None
        if self.prompt_ids.numel() == 0:
            why = "empty prompt_ids; expected >= 1 prompt token"
        elif n == 0:
            why = "empty output_ids; expected >= 1 generated token"
        for name in TOKEN_COLUMNS:
            x = getattr(self, name)
            if why is None and x is not None and x.numel() != n:
                why = f"len({name})={x.numel()}, expected len(output_ids)={n}"
        if why is None and self.loss_mask is not None and not bool(self.loss_mask.any()):
            why = "loss_mask trains no token; expected at least one True"
        if why is not None:
            raise ValueError(f"trajectory {self.sample_id!r}: {why}")

    @classmethod
    def row(cls, **values) -> "Trajectory":
        """A row from values already in their column's dtype (a batch's views, an engine's tensors), not
        checked (an engine's aborted sample may have no token); fields not given take their defaults."""
        row = object.__new__(cls)
        for name, default in _ROW_DEFAULTS.items():
            setattr(row, name, values.pop(name, default))
        if values:
            raise TypeError(f"Trajectory.row: unknown fields {sorted(values)}")
        return row

    def scored(self, score: float) -> "Trajectory":
        """This row (its tensors kept as they are) with ``score``, its fields checked: what a trainer step
        takes of a received row (one call a row a step, so without ``dataclasses.replace``'s generic copy)."""
        row = object.__new__(Trajectory)
        for name, value in zip(_FIELD_NAMES, _ALL_FIELDS(self)):
            setattr(row, name, value)
        row.score = float(score)
        row._check()  # (its tensors are of their column's dtype: a row is built checked, or from a batch's)
        return row

    @property
    def seq_ids(self) -> torch.Tensor:
        """Prompt followed by output: what the trainer feeds the model (a new tensor)."""
        return torch.cat([self.prompt_ids, self.output_ids])

    @property
    def seq_parts(self):
        """(prompt_ids, output_ids): ``packing.pack`` copies them straight into the packed batch; with
        ``segment_starts``, the same parts as a ``Segmented`` sequence (attention restarts at each start)."""
        if not self.segment_starts:
            return self.prompt_ids, self.output_ids
        n = self.prompt_ids.numel()
        return Segmented((self.prompt_ids, self.output_ids), tuple(n + s for s in self.segment_starts))

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any trained token (staleness is judged by it)."""
        return int(self.model_versions.min())

    @property
    def model_versions(self) -> torch.Tensor:
        """Versions of the trained tokens (a workflow's environment tokens carry -1)."""
        return self.versions if self.loss_mask is None else self.versions[self.loss_mask]


_SPEC = {f.name: f.metadata for f in fields(Trajectory) if "dtype" in f.metadata}
_ROW_DEFAULTS = {f.name: None if f.name != "score" else math.nan for f in fields(Trajectory)}
_FIELD_NAMES = tuple(_ROW_DEFAULTS)
_ALL_FIELDS = operator.attrgetter(*_FIELD_NAMES)
COLUMNS: dict[str, torch.dtype] = {name: m["dtype"] for name, m in _SPEC.items()}  # name -> its one dtype
OPTIONAL = frozenset(name for name, m in _SPEC.items() if m["optional"])
TOKEN_COLUMNS = tuple(name for name, m in _SPEC.items() if m["per"] == TOKEN)
TENSOR_COLUMNS = {name: d for name, d in COLUMNS.items() if _SPEC[name]["per"] != SAMPLE}  # tensors in a row
_META_FIELDS = ("group_ids", "group_sizes", "prompt_lengths", "sample_ids", "lengths")


@dataclass(eq=False)
class TrajectoryBatch:
    """The samples of ``group_ids`` in the layout of the module docstring: ``columns`` maps each column
    present to its 1D tensor (of its dtype); a column is also an attribute (``batch.logprobs``; an
    optional one absent: None)."""

    group_ids: list[str]
    group_sizes: list[int]
    prompt_lengths: list[int]
    sample_ids: list[str]
    lengths: list[int]
    columns: dict[str, torch.Tensor]
    segment_starts: Optional[list[list[int]]] = None  # one list a sample (an agent's segments); None: none
    finish_reasons: Optional[list[str]] = None  # one a sample, the engine's; not on the wire (TrajectoryReady has them)

    def __getattr__(self, name: str):
        if name in COLUMNS:  # (called only for names that are not attributes)
            return self.__dict__.get("columns", {}).get(name)
        raise AttributeError(f"TrajectoryBatch has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in COLUMNS:
            object.__setattr__(self, name, value)
        elif value is None:
            self.columns.pop(name, None)
        else:  # a column is set in ``columns``, where encode reads it
            self.columns[name] = value

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
        **more,
    ) -> "TrajectoryBatch":
        """One group: its prompt once, its samples' outputs end to end (``lengths[i]`` tokens of sample i);
        ``more``: other optional columns by name. Tensors or lists, converted to their column's dtype (a
        1D tensor already of it is kept as is)."""
        given = dict(prompt_ids=prompt_ids, output_ids=output_ids, logprobs=logprobs, versions=versions)
        given.update(loss_mask=loss_mask, **more)
        unknown = sorted(set(given) - set(COLUMNS))
        if unknown:
            raise ValueError(f"TrajectoryBatch.group {group_id!r}: unknown columns {unknown}; expected {list(COLUMNS)}")
        columns = {name: as_column(x, name) for name, x in given.items() if x is not None}
        return cls(
            group_ids=[group_id],
            group_sizes=[len(sample_ids)],
            prompt_lengths=[columns["prompt_ids"].numel()],
            sample_ids=list(sample_ids),
            lengths=[int(n) for n in lengths],
            columns=columns,
            segment_starts=_segments(segment_starts),
        )

    @classmethod
    def join(cls, batches: Sequence["TrajectoryBatch"]) -> "TrajectoryBatch":
        """Several batches as one, in order (one batch: itself; one copy of each column). An optional
        column on some batches only is refused (``of_samples`` fills one in for the rows without it)."""
        if not batches:
            raise ValueError("TrajectoryBatch.join got no batches; expected at least one")
        if len(batches) == 1:
            return batches[0]
        names = list(batches[0].columns)
        if any(list(b.columns) != names for b in batches):
            have = sorted({tuple(b.columns) for b in batches})
            raise ValueError(f"TrajectoryBatch.join: the batches carry different columns {have}; expected the same")
        lists = {f: [x for b in batches for x in getattr(b, f)] for f in _META_FIELDS}
        columns = {name: torch.cat([b.columns[name] for b in batches]) for name in names}
        segs = None
        if any(b.segment_starts for b in batches):
            segs = [list(x) for b in batches for x in (b.segment_starts or [[]] * len(b.sample_ids))]
        reasons = None
        if all(b.finish_reasons is not None for b in batches):
            reasons = [x for b in batches for x in b.finish_reasons]
        return cls(**lists, columns=columns, segment_starts=segs, finish_reasons=reasons)

    @classmethod
    def of_samples(cls, rows: Sequence[Trajectory]) -> "TrajectoryBatch":
        """Rows back into one batch: consecutive rows of one group id and one prompt share a group. Each
        column is a view when the rows' tensors lie end to end in one tensor (the rows of one message, or
        of a rank broadcast, in order), else one copy. An optional column that some rows have is filled in
        for the others with its ``fill`` (a loss mask: all trained; a score: NaN); one no row has is left out."""
        if not rows:
            raise ValueError("TrajectoryBatch.of_samples got no rows; expected at least one")
        runs = [list(run) for _, run in itertools.groupby(rows, key=_RunKey)]
        firsts, lengths = [run[0] for run in runs], [r.output_ids.numel() for r in rows]
        prompt_lengths = [r.prompt_ids.numel() for r in firsts]
        columns = {"prompt_ids": _column(firsts, "prompt_ids", prompt_lengths)}
        columns |= {name: _column(rows, name, lengths) for name in TOKEN_COLUMNS}
        columns = {name: x for name, x in columns.items() if x is not None}
        _one_device(list(columns.values()))
        scores = [r.score for r in rows]
        if not all(math.isnan(s) for s in scores):
            columns["score"] = torch.tensor(scores, dtype=COLUMNS["score"])
        reasons = [r.finish_reason for r in rows]
        return cls(
            group_ids=[r.group_id for r in firsts],
            group_sizes=[len(run) for run in runs],
            prompt_lengths=prompt_lengths,
            sample_ids=[r.sample_id for r in rows],
            lengths=lengths,
            columns=columns,
            segment_starts=_segments([r.segment_starts or [] for r in rows]),
            finish_reasons=reasons if None not in reasons else None,
        )

    @property
    def group_id(self) -> str:
        """The id of this batch's one group (an engine's output); ``ValueError`` for several groups."""
        if len(self.group_ids) != 1:
            raise ValueError(f"a batch of {len(self.group_ids)} groups has no one group_id; read group_ids")
        return self.group_ids[0]

    # ---- the wire --------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """The message's key on a tensor channel: its first group id."""
        return self.group_ids[0]

    @property
    def nbytes(self) -> int:
        """Payload bytes: the tensors', and 4 a count in the meta (as if they were int32 tensors)."""
        counts = 4 * (len(self.group_ids) + len(self.sample_ids))
        return counts + sum(t.numel() * t.element_size() for t in self.columns.values())

    def meta(self) -> dict:
        out = {f: getattr(self, f) for f in _META_FIELDS}
        if self.segment_starts:
            out["segment_starts"] = self.segment_starts
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The columns present, in their declared order."""
        return {name: self.columns[name] for name in COLUMNS if name in self.columns}

    def encode(self) -> tuple[str, dict[str, torch.Tensor], dict]:
        """(key, tensors, meta): the arguments of ``TensorChannel.send``, checked first (the counts'
        consistency and the tensors against them; the meta's field types are the receiver's check)."""
        where = f"trajectory message {self.group_ids[0] if self.group_ids else '(no group)'!r}"
        why = trajectory_counts_problem(self)
        if why:
            raise ProtocolError(f"{where}: trajectory_meta: {why}")
        self._check_tensors(where)
        return self.key, self.tensors(), self.meta()

    @classmethod
    def decode(cls, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> "TrajectoryBatch":
        """``TensorChannel.recv``'s (key, meta, tensors) -> the batch, every field checked
        (``ProtocolError`` naming the first mismatch)."""
        where = f"trajectory message {key!r}"
        m = _meta(where, meta)
        names = set(tensors) if isinstance(tensors, dict) else set()
        if not _REQUIRED <= names <= set(COLUMNS):
            raise ProtocolError(
                f"{where}: tensors {sorted(names)}; expected {sorted(_REQUIRED)} and optionally {sorted(OPTIONAL)}"
            )
        batch = cls(m.group_ids, m.group_sizes, m.prompt_lengths, m.sample_ids, m.lengths, dict(tensors))
        batch.segment_starts = _segments(m.segment_starts)
        batch._check_tensors(where)
        return batch

    def _check_tensors(self, where: str) -> None:
        """Every column 1D of its dtype and as long as the counts say."""
        want = {TOKEN: (sum(self.lengths), "the output lengths' sum"), SAMPLE: (len(self.sample_ids), "one a sample")}
        want[PROMPT] = (sum(self.prompt_lengths), "the prompt lengths' sum")
        for name, dtype in COLUMNS.items():
            t = self.columns.get(name)
            if t is None and name in OPTIONAL:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ProtocolError(f"{where}: {name} is {got}; expected a 1D {dtype} tensor")
            n, what = want[_SPEC[name]["per"]]
            if t.numel() != n:  # (the message is built only when it is wrong)
                raise ProtocolError(f"{where}: {name} has {t.numel()} entries; expected {n} ({what})")

    # ---- reading ---------------------------------------------------------------------------
    def samples(self) -> list[Trajectory]:
        """One row per sample, in order: views of this batch's tensors (no copy), not checked again (the
        batch was); ``Trajectory.scored`` checks a row the trainer takes."""
        lengths, sizes, n = self.lengths, self.group_sizes, len(self.sample_ids)
        prompts = [self.prompt_ids] if len(sizes) == 1 else self.prompt_ids.split_with_sizes(self.prompt_lengths)
        per_row = {
            "group_id": [g for g, k in zip(self.group_ids, sizes) for _ in range(k)],
            "prompt_ids": [p for p, k in zip(prompts, sizes) for _ in range(k)],
            "score": self.score.tolist() if self.score is not None else [math.nan] * n,
            "segment_starts": [s or None for s in self.segment_starts] if self.segment_starts else [None] * n,
            "finish_reason": self.finish_reasons or [None] * n,
        }
        for name in TOKEN_COLUMNS:
            t = self.columns.get(name)
            per_row[name] = [None] * n if t is None else t.split_with_sizes(lengths)
        rows = []
        for i, sid in enumerate(self.sample_ids):
            row = object.__new__(Trajectory)
            row.sample_id = sid
            for name, values in per_row.items():
                setattr(row, name, values[i])
            rows.append(row)
        return rows

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)


_REQUIRED = frozenset(COLUMNS) - OPTIONAL


class _RunKey:
    """``itertools.groupby`` key: rows of one group id and one prompt (the same tensor, or equal ones)."""

    __slots__ = ("row",)

    def __init__(self, row: Trajectory):
        self.row = row

    def __eq__(self, other: "_RunKey") -> bool:
        a, b = self.row, other.row
        if a.group_id != b.group_id:
            return False
        p, q = a.prompt_ids, b.prompt_ids
        return p is q or (p.shape == q.shape and p.device == q.device and torch.equal(p, q))


def _one_device(tensors: Sequence[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"trajectory tensors are on {sorted(map(str, devices))}; expected all on one device")


def _filled(row: Trajectory, name: str) -> torch.Tensor:
    x = getattr(row, name)
    if x is not None:
        return x
    return torch.full((row.output_ids.numel(),), _SPEC[name]["fill"], dtype=COLUMNS[name], device=row.output_ids.device)


def _meta(where: str, meta) -> TrajectoryMeta:
    try:
        return build(TrajectoryMeta, meta)
    except ProtocolError as e:
        raise ProtocolError(f"{where}: {e}") from None


def as_column(x, name: str) -> torch.Tensor:
    """``x`` as a 1D tensor of the dtype of column ``name`` (kept as is when it already is one)."""
    dtype = COLUMNS[name]
    if isinstance(x, torch.Tensor):
        x = x if x.dtype == dtype else x.to(dtype)
        return x.reshape(-1) if x.dim() != 1 else x
    return torch.tensor(list(x), dtype=dtype)


def _segments(segs) -> Optional[list[list[int]]]:
    """Per-sample segment starts, or None when no sample has any (the layout without them)."""
    return [list(s) for s in segs] if segs and any(segs) else None


def _column(rows: Sequence[Trajectory], name: str, counts: list[int]) -> Optional[torch.Tensor]:
    """Column ``name`` of ``rows`` (``counts[i]`` entries of row i) end to end; an optional one with the
    rows without it filled in, or None when no row has it."""
    parts = list(map(operator.attrgetter(name), rows))
    if name in OPTIONAL:
        if all(p is None for p in parts):
            return None
        parts = [_filled(r, name) if p is None else p for r, p in zip(rows, parts)]
    return as_column(_cat(parts, counts), name)


def _cat(parts: list[torch.Tensor], counts: Optional[list[int]] = None) -> torch.Tensor:
    """``parts`` (of ``counts[i]`` entries) end to end: a view when they already lie so in one tensor,
    else one copy."""
    if len(parts) == 1:
        return parts[0]
    whole = _adjacent(parts, counts or [p.numel() for p in parts])
    if whole is not None:
        return whole
    try:
        return torch.cat(parts)
    except RuntimeError:
        _one_device(parts)  # the error naming the devices, if that is what it is
        raise


def _adjacent(parts: list[torch.Tensor], counts: list[int]) -> Optional[torch.Tensor]:
    """The 1D view that ``parts`` are consecutive pieces of (views of one tensor, each starting where the
    previous ends: ``split`` of a column, a row's views of a message), or None. First the span from the
    first part to the last (parts of several tensors mostly fail there), then each part."""
    first, last = parts[0], parts[-1]
    base, dtype, size, total = first._base, first.dtype, first.element_size(), sum(counts)
    start = end = first.data_ptr()
    if base is None or last._base is not base or last.data_ptr() + counts[-1] * size - start != total * size:
        return None
    for p, n in zip(parts, counts):
        if p._base is not base or p.data_ptr() != end or p.dtype is not dtype or (n > 1 and not p.is_contiguous()):
            return None
        end += n * size
    return first.as_strided((total,), (1,))
