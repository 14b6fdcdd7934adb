"""A few scored completions per reward worker, as the reward saw them: ``RUN_DIR/reward_samples/<id>.jsonl``.

One line per recorded group: its references, the first ``PER_GROUP`` completions (cut to
``MAX_CHARS``), their scores, statuses and details, and the last ``\\boxed{}`` answer of each (the
default reward's parse; a reward function of its own that reads another format shows it here as
scored 0 beside a boxed answer equal to the reference). Recorded: the first ``FIRST_GROUPS`` groups,
then one in ``EVERY`` groups, at most ``MAX_LINES`` lines per worker, so ``areal-async doctor`` can
quote what the reward saw at the start and later in the run, in a file of a few hundred KiB at most.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from areal_async.reward.answers import extract_boxed

log = logging.getLogger("areal_async.reward")

SAMPLES_DIR = "reward_samples"
FIRST_GROUPS, EVERY, MAX_LINES = 16, 50, 200
PER_GROUP, MAX_CHARS = 2, 400


class RewardSampleLog:
    def __init__(self, run_dir: str | Path, worker_id: str):
        self.path = Path(run_dir) / SAMPLES_DIR / f"{worker_id}.jsonl"
        self.n_groups = self.n_lines = 0
        self._file = None

    def due(self) -> bool:
        """Whether the next group is one to record (counts it)."""
        k, self.n_groups = self.n_groups, self.n_groups + 1
        return self.n_lines < MAX_LINES and (k < FIRST_GROUPS or k % EVERY == 0)

    def group(self, group_id: str, completions: list[str], solutions: list[str], outcomes: list) -> None:
        """Record this group when it is due; a write that fails is logged once and recording stops."""
        if not self.due():
            return
        line = sample_line(group_id, completions, solutions, outcomes)
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
            self.n_lines += 1
        except OSError as e:
            log.warning("reward samples not recorded in %s: %s", self.path, e)
            self.n_lines = MAX_LINES

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def sample_line(group_id: str, completions: list[str], solutions: list[str], outcomes: list) -> dict:
    kept = list(zip(completions, outcomes))[:PER_GROUP]
    return {
        "group_id": group_id,
        "solutions": [s[:MAX_CHARS] for s in solutions],
        "completions": [c[:MAX_CHARS] for c, _ in kept],
        "boxed": [_boxed(c) for c, _ in kept],
        "scores": [float(o.score) for _, o in kept],
        "statuses": [o.status for _, o in kept],
        "details": [o.detail[:200] for _, o in kept],
        "group_scores": [float(o.score) for o in outcomes],
    }


def _boxed(text: str) -> Optional[str]:
    return extract_boxed(text) if isinstance(text, str) else None
