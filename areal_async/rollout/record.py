"""A rollout worker's own record of what it produced: ``RUN_DIR/rollout_records/<worker id>.jsonl``
(format: ``base/records.py``): a ``start`` line per process, a ``loaded`` line per weight version its
engine acknowledged loading, a ``group`` line per group, written and flushed before the group's
tensors leave for the trainer. ``areal-async verify`` reads it beside the scheduler's books, the
trainer's record and the reward workers' records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from protocols.messages import TrajectoryReady

from areal_async.base.records import ROLLOUT_DIR, JsonlRecord, token_digest, worker_record_path


class RolloutRecord:
    """Appends to ``RUN_DIR/rollout_records/<worker_id>.jsonl``; a ``start`` line first (a restarted
    worker's engine has loaded nothing yet: verify judges each life's stamps by its own loads)."""

    def __init__(self, run_dir: str | Path, worker_id: str):
        self.worker = worker_id
        self.file = JsonlRecord(worker_record_path(run_dir, ROLLOUT_DIR, worker_id))
        self.file.write({"kind": "start", "pid": os.getpid()})

    def loaded(self, version: int) -> None:
        """The engine acknowledged loading ``version`` (its WeightsLoaded leaves next)."""
        self.file.write({"kind": "loaded", "version": int(version)})

    def groups(
        self,
        groups: list[TrajectoryReady],
        n_loss: Optional[Sequence[list[int]]] = None,
        outputs: Optional[Sequence[Sequence]] = None,
    ) -> None:
        """One line per group (the values its TrajectoryReady carries, written here first); ``n_loss``:
        per group, its samples' trained-token counts where a loss mask leaves tokens untrained; ``outputs``:
        per group, its samples' output ids as generated (their digests are recorded)."""
        losses = n_loss if n_loss is not None else [None] * len(groups)
        outs = outputs if outputs is not None else [None] * len(groups)
        self.file.write(*(self.line(g, n, o) for g, n, o in zip(groups, losses, outs)))

    def line(self, g: TrajectoryReady, n_loss: Optional[list[int]] = None, outputs: Optional[Sequence] = None) -> dict:
        digests = {"tok_digest": [token_digest(ids) for ids in outputs]} if outputs is not None else {}
        return (
            digests
            | {
                "kind": "group",
                "group_id": g.group_id,
                "ids": list(g.sample_ids),
                "vmin": list(g.version_min),
                "vmax": list(g.version_max),
                "n_tokens": list(g.n_output_tokens),
                "n_prompt": g.n_prompt_tokens,
            }
            | ({"n_loss": list(n_loss)} if n_loss is not None else {})
        )

    def close(self) -> None:
        self.file.close()
