"""The run directory's books: metrics.jsonl, trajectories.jsonl, summary.json.

- ``metrics.jsonl``: one object per RL trainer step (step, version, reward_mean, staleness_max,
  samples_trained, wall_s, plus the trainer's own metrics).
- ``trajectories.jsonl`` (every run): one object per sample when it ends,
  trained or aborted (id, prompt_id, status, train_step, version_min, version_max, reward...).
- ``summary.json``: written once at the end.

Metrics rows also go to the ``StatsSink``s given (TensorBoard, wandb: ``sinks.py``); a sink that
fails is logged and dropped, and metrics.jsonl stays the record.

Lines are flushed as they are written so a crash loses nothing already logged; the samples that end
together (a trained step's, an aborted group's) are written and flushed as one ``write``, each line
as ``json.dumps(sample_line(rec))`` writes it (``sample_text``: the same bytes, without the dict). A resumed run
truncates both jsonl files back to the byte offsets stored in its checkpoint and keeps what it
cut in ``*.rolled_back.jsonl``: the books then continue from the checkpoint's accounting.
"""

from __future__ import annotations

import json
import logging
import os
from json.encoder import encode_basestring_ascii as _str
from pathlib import Path
from typing import Iterable, Optional

from areal_async.scheduler.ledger import SampleRecord, SampleState
from areal_async.scheduler.sinks import StatsSink

log = logging.getLogger("areal_async.scheduler")


def sample_line(rec: SampleRecord) -> dict:
    return {
        "id": rec.sample_id,
        "prompt_id": rec.prompt_id,
        "group_id": rec.group_id,
        "status": rec.status,
        "train_step": rec.train_step if rec.status == SampleState.TRAINED else None,
        "version_min": rec.version_min,
        "version_max": rec.version_max,
        "reward": rec.score,
        "reward_status": rec.reward_status,
        "n_output_tokens": rec.n_output_tokens,
        "finish_reason": rec.finish_reason,
        "turns": rec.turns,
        "worker": rec.worker,
        "reason": rec.reason or None,
    }


def sample_text(rec: SampleRecord) -> str:
    """``json.dumps(sample_line(rec))``, byte for byte, formatted straight from the record (an f-string:
    a third of the time of the dict and the encoder). Values of any other type than the books hold (an
    int that is not exactly an int, a score neither None nor a finite float, a str field that is not a
    str) take ``json.dumps`` itself."""
    s, step = rec.score, rec.train_step if rec.status == SampleState.TRAINED else None
    ints = type(rec.version_min) is type(rec.version_max) is type(rec.n_output_tokens) is type(rec.turns) is int
    finite = s is None or (type(s) is float and s - s == 0.0)
    if not (ints and finite and (step is None or type(step) is int)):
        return json.dumps(sample_line(rec))
    try:
        return (
            f'{{"id": {_str(rec.sample_id)}, "prompt_id": {_str(rec.prompt_id)}, "group_id": {_str(rec.group_id)}, '
            f'"status": {_str(rec.status)}, "train_step": {"null" if step is None else step}, '
            f'"version_min": {rec.version_min}, "version_max": {rec.version_max}, '
            f'"reward": {"null" if s is None else _repr(s)}, "reward_status": {_str(rec.reward_status)}, '
            f'"n_output_tokens": {rec.n_output_tokens}, "finish_reason": {_str(rec.finish_reason)}, '
            f'"turns": {rec.turns}, "worker": {_str(rec.worker)}, '
            f'"reason": {_str(rec.reason) if rec.reason else "null"}}}'
        )
    except TypeError:  # a field that is not a str
        return json.dumps(sample_line(rec))


_repr = float.__repr__  # what json writes for a finite float


def samples_text(recs: Iterable[SampleRecord]) -> str:
    """The lines of ``recs``, each ``sample_text(rec) + "\n"`` byte for byte. Records that end together come
    group by group (a step's, an aborted group's): the fields a group's records share (the very same
    objects: prompt, group, status, step, worker, reason) are formatted once per run of them, the rest per
    record. A record of any other type than the books hold takes ``sample_text``."""
    parts, last, shared = [], _NONE, None
    for rec in recs:
        if (
            rec.group_id is not last.group_id
            or rec.prompt_id is not last.prompt_id
            or rec.status is not last.status
            or rec.train_step is not last.train_step
            or rec.worker is not last.worker
            or rec.reason is not last.reason
        ):
            last, shared = rec, _shared(rec)
        s = rec.score
        if (
            shared is None
            or type(rec.version_min) is not int
            or type(rec.version_max) is not int
            or type(rec.n_output_tokens) is not int
            or type(rec.turns) is not int
            or not (s is None or (type(s) is float and s - s == 0.0))
            or type(rec.sample_id) is not str
            or type(rec.reward_status) is not str
            or type(rec.finish_reason) is not str
        ):
            parts.append(sample_text(rec) + "\n")
            continue
        parts.append(
            f'{{"id": {_str(rec.sample_id)}, {shared[0]}{rec.version_min}, "version_max": {rec.version_max}, '
            f'"reward": {"null" if s is None else _repr(s)}, "reward_status": {_str(rec.reward_status)}, '
            f'"n_output_tokens": {rec.n_output_tokens}, "finish_reason": {_str(rec.finish_reason)}, '
            f'"turns": {rec.turns}{shared[1]}'
        )
    return "".join(parts)


def _shared(rec: SampleRecord) -> Optional[tuple[str, str]]:
    """The text around a record's own fields (``_own``): what its group's records share; None: odd types."""
    step = rec.train_step if rec.status == SampleState.TRAINED else None
    if not (step is None or type(step) is int) or type(rec.reason) is not str:
        return None
    try:
        head = (
            f'"prompt_id": {_str(rec.prompt_id)}, "group_id": {_str(rec.group_id)}, "status": {_str(rec.status)}, '
            f'"train_step": {"null" if step is None else step}, "version_min": '
        )
        tail = f', "worker": {_str(rec.worker)}, "reason": {_str(rec.reason) if rec.reason else "null"}}}\n'
    except TypeError:
        return None
    return head, tail


class _Nothing:
    """A record whose fields are nobody's: the first record of a call starts a run of its own."""

    group_id = prompt_id = status = train_step = worker = reason = object()


_NONE = _Nothing()


class RunLog:
    def __init__(self, run_dir: str | Path, dump_trajectories: bool, sinks: list[StatsSink] | None = None):
        self.dir = Path(run_dir)
        self.sinks = list(sinks or [])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.traj_path = self.dir / "trajectories.jsonl" if dump_trajectories else None
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self._traj = open(self.traj_path, "a", encoding="utf-8") if self.traj_path else None
        self.n_sample_lines = 0

    def sample(self, rec: SampleRecord) -> None:
        self.samples([rec])

    def samples(self, recs: list[SampleRecord]) -> None:
        """The lines of samples that ended together: one write, one flush."""
        self.n_sample_lines += len(recs)
        if self._traj and recs:
            self._traj.write(samples_text(recs))
            self._traj.flush()

    def metrics(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        for sink in list(self.sinks):
            try:
                sink.log(row)
            except Exception:  # any failure of a sink's library: the jsonl row is written, drop the sink
                log.exception("metrics sink %s failed; it gets no more rows", type(sink).__name__)
                self.sinks.remove(sink)

    def offsets(self) -> dict:
        return {"metrics": self._metrics.tell(), "trajectories": self._traj.tell() if self._traj else 0}

    def summary(self, row: dict) -> None:
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(json.dumps(row, indent=2) + "\n")
        os.replace(tmp, self.dir / "summary.json")

    def close(self) -> None:
        for f in (self._metrics, self._traj):
            if f:
                f.close()
        for sink in self.sinks:
            sink.close()

    @staticmethod
    def rollback(run_dir: str | Path, offsets: dict) -> dict:
        """Cut metrics/trajectories back to a checkpoint's offsets; returns lines cut per file."""
        cut = {}
        for name in ("metrics", "trajectories"):
            path = Path(run_dir) / f"{name}.jsonl"
            if path.exists():
                cut[name] = _truncate(path, int(offsets.get(name, 0)), Path(run_dir) / f"{name}.rolled_back.jsonl")
        return cut


def _truncate(path: Path, offset: int, keep: Path) -> int:
    data = path.read_bytes()
    if offset > len(data):
        raise ValueError(f"{path}: checkpoint offset {offset} is past the end ({len(data)} bytes)")
    tail = data[offset:]
    if tail:
        with open(keep, "ab") as f:
            f.write(tail)
    with open(path, "r+b") as f:
        f.truncate(offset)
    return tail.count(b"\n")
