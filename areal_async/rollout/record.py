"""A rollout worker's own record of what it produced: ``RUN_DIR/rollout_records/<worker id>.jsonl``
(format: ``base/records.py``), one line per group, written and flushed before the group's
tensors leave for the trainer. ``areal-async verify`` reads it as the third source beside the
scheduler's books and the trainer's record."""

from __future__ import annotations

import re
from pathlib import Path

from protocols.messages import TrajectoryReady

from areal_async.base.records import ROLLOUT_DIR, JsonlRecord

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class RolloutRecord:
    """Appends to ``RUN_DIR/rollout_records/<worker_id>.jsonl``."""

    def __init__(self, run_dir: str | Path, worker_id: str):
        if not _SAFE_ID.fullmatch(worker_id):
            raise ValueError(f"worker id {worker_id!r} cannot name a record file; expected 1-128 of A-Z a-z 0-9 _ . -")
        self.worker = worker_id
        self.file = JsonlRecord(Path(run_dir) / ROLLOUT_DIR / f"{worker_id}.jsonl")

    def groups(self, groups: list[TrajectoryReady]) -> None:
        """One line per group (the values its TrajectoryReady carries, written here first)."""
        self.file.write(*(self.line(g) for g in groups))

    def line(self, g: TrajectoryReady) -> dict:
        return {
            "group_id": g.group_id,
            "ids": list(g.sample_ids),
            "vmin": list(g.version_min),
            "vmax": list(g.version_max),
            "n_tokens": list(g.n_output_tokens),
        }

    def close(self) -> None:
        self.file.close()
