"""The workers' own records in the run directory: what the trainer trained, what each rollout produced,
what each reward worker scored.

The scheduler keeps the run's books (``trajectories.jsonl``, ``metrics.jsonl``, ``summary.json``,
``resumes.json``); these records are written by the other side of each hand-over, in other processes,
so that ``areal-async verify RUN_DIR`` (``areal_async.app.commands.verify``) can check the books against them:

- ``trainer_steps.jsonl`` (trainer rank 0, which holds the whole batch; the other ranks train
  their shares of the same broadcast batch and write nothing): one line per trainer step
  (``kind`` "step") with the sample ids in the order trained, each one's min/max per-token
  policy version, trained-token, output-token and prompt-token counts as read from the tensors the
  step used, a digest of each one's output token ids (``token_digest``), the score each was trained
  with, and whether the optimizer step was applied; and one
  line (``kind`` "duplicate") per sample id that arrived twice at the trainer's buffer (the second
  copy refused). A resumed trainer moves the lines of steps at or after its checkpoint's next step to
  ``trainer_steps.rolled_back.jsonl`` (as the scheduler rolls its books back to the same checkpoint).
- ``rollout_records/<worker id>.jsonl`` (each rollout worker): a ``start`` line when the process
  opens it; a ``loaded`` line per weight version its engine acknowledged loading (written as the
  ``WeightsLoaded`` leaves); a ``group`` line per group it produced, written and flushed before the
  group's tensors leave for the trainer: sample ids, per-sample min/max version, output-token (and,
  for a workflow's episodes, trained-token) counts and output-id digests, the prompt's token count.
  Nothing is rolled back here: a sample produced after the checkpoint a run resumed from may be in no
  book (its prompt was re-issued under an id of the resumed run's prefix, ``r<k>-``; ``resumes.json``
  says which).
- ``reward_records/<worker id>.jsonl`` (each reward worker, built-in or brought; a rollout worker
  for the episodes its workflow scored): one line per group scored, its ids, scores and statuses,
  written and flushed before the result leaves for the scheduler.

Every run writes them (a line per group or step; ``rollout.dump_to_file`` is retired): verify
needs all of them, and a run without them has nothing to check against.

Lines are flushed as written: a SIGKILL loses at most the line being written (the reader drops
a torn last line).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Sequence

TRAINER_STEPS = "trainer_steps.jsonl"
TRAINER_ROLLED_BACK = "trainer_steps.rolled_back.jsonl"
ROLLOUT_DIR = "rollout_records"
REWARD_DIR = "reward_records"
# rollout.dump_tensors: the trainer's batches with their tensors, one file per step (trainer/persist/recording.py)
RECORDING_DIR = "recording"
RECORDING_HEADER = "header.json"


def recorded_steps(run_dir: str | Path) -> list[int]:
    """Steps with a file in the run's recording (``recording/step_<k>.safetensors``), ascending."""
    d = Path(run_dir) / RECORDING_DIR
    if not d.is_dir():
        return []
    return sorted(int(p.stem[5:]) for p in d.glob("step_*.safetensors") if p.stem[5:].isdigit())


_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def token_digest(ids) -> str:
    """A sample's output token ids as 16 hex digits (blake2b of the ids as little-endian int32): the rollout
    and the trainer each write it from the ids in their hands, so ``verify`` sees a decode and re-encode, or
    any other change of ids between generation and training, as two digests that differ."""
    import hashlib

    import numpy as np

    arr = ids.numpy() if hasattr(ids, "numpy") else np.asarray(ids)
    return hashlib.blake2b(np.ascontiguousarray(arr, dtype="<i4").tobytes(), digest_size=8).hexdigest()


def worker_record_path(run_dir: str | Path, folder: str, worker_id: str) -> Path:
    """``RUN_DIR/<folder>/<worker_id>.jsonl``; ValueError for an id that cannot name a file."""
    if not _SAFE_ID.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} cannot name a record file; expected 1-128 of A-Z a-z 0-9 _ . -")
    return Path(run_dir) / folder / f"{worker_id}.jsonl"


class JsonlRecord:
    """An append-only jsonl file, one flushed line per ``write`` (thread-safe). Opening it drops a torn last
    line (a writer of the same file killed mid-line: a restarted worker appends to its predecessor's record),
    as a reader would skip it, so the lines appended after it stay lines."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, *rows: dict) -> None:
        """The rows, one line each, flushed together."""
        text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
        with self._lock:
            self._f.write(text)
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


class RewardRecord:
    """``RUN_DIR/reward_records/<worker_id>.jsonl``: what one worker scored, one line per group, written
    before the result leaves for the scheduler. ``areal-async verify`` holds the scores the books and
    the trainer used against it: a score that reached the wrong sample on its way (a misaligned message,
    a mixed-up booking) shows there. Written by the built-in reward workers (``reward/service.py``),
    brought ones (``client/reward.py``) and rollout workers for the episodes their workflow scored."""

    def __init__(self, run_dir: str | Path, worker_id: str):
        self.worker = worker_id
        self.file = JsonlRecord(worker_record_path(run_dir, REWARD_DIR, worker_id))

    def groups(self, scored: Sequence[tuple[str, Sequence[str], Sequence[float], Sequence[str]]]) -> None:
        """One line per (group id, sample ids, scores, statuses), flushed together."""
        self.file.write(*(reward_line(*g) for g in scored))

    def close(self) -> None:
        self.file.close()


def reward_line(group_id: str, sample_ids: Sequence[str], scores: Sequence[float], statuses: Sequence[str]) -> dict:
    if not len(sample_ids) == len(scores) == len(statuses):
        raise ValueError(
            f"group {group_id!r}: {len(sample_ids)} ids, {len(scores)} scores, {len(statuses)} statuses; "
            "expected one score and status per id"
        )
    return {
        "group_id": group_id,
        "ids": list(sample_ids),
        "scores": [float(x) for x in scores],
        "statuses": list(statuses),
    }


def drop_torn_tail(path: Path, chunk: int = 1 << 20) -> int:
    """Cut ``path`` back to its last newline (bytes after it: a line whose writer died); returns bytes cut."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = end = f.seek(0, os.SEEK_END)
        while end > 0:  # back from the end, a chunk at a time, to the last newline
            start = max(0, end - chunk)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return 0
            at = block.rfind(b"\n")
            if at >= 0:
                f.truncate(start + at + 1)
                return size - (start + at + 1)
            end = start
        f.truncate(0)
        return size


def read_jsonl(path: str | Path) -> tuple[list[dict], list[str]]:
    """(rows, problems): every parsable line; a torn last line (a writer killed mid-line) is
    skipped silently, any other bad line is a problem naming its line number."""
    rows, problems = [], []
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                continue  # torn last line
            problems.append(f"{path}:{i}: not JSON ({e.msg})")
    return rows, problems


class JsonlTail:
    """The rows appended to a jsonl file since the last ``read``: complete lines only (a half-written
    last line waits for its newline), a line that is not JSON skipped; no file yet reads as no rows."""

    def __init__(self, path: str | Path):
        self.path, self.offset = Path(path), 0  # bytes already read

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        rows = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows


def roll_back_steps(run_dir: str | Path, start_step: int) -> int:
    """Move the trainer's lines of steps >= ``start_step`` (and a torn last line) from
    ``trainer_steps.jsonl`` to ``trainer_steps.rolled_back.jsonl``; returns how many moved.
    A resumed trainer calls it before it trains: its record then continues from its checkpoint."""
    path = Path(run_dir) / TRAINER_STEPS
    if not path.exists():
        return 0
    keep, cut = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            row = None
        if row is None or (row.get("kind") == "step" and int(row.get("step", -1)) >= start_step):
            cut.append(line if line.endswith("\n") else line + "\n")
        else:
            keep.append(line)
    if cut:
        with open(Path(run_dir) / TRAINER_ROLLED_BACK, "a", encoding="utf-8") as f:
            f.writelines(cut)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, path)
    return len(cut)
