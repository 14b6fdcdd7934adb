"""The trainer's own record of what it trained: ``RUN_DIR/trainer_steps.jsonl`` (format: ``base/records.py``).

Written by trainer rank 0 (the ``TrainerService``), which receives every trajectory and
broadcasts the batch to the other ranks, from the trajectories the step's ``train_step`` took
(the tensors themselves, not the rollout's or the scheduler's word about them; the scores are those the
step's plan gave, as trained), before the step's
``TrainStepDone`` leaves: a step the scheduler books is in this record unless a crash came
between the two, and then the resumed trainer rolls the line back (``roll_back_steps``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from areal_async.base.records import TRAINER_STEPS, JsonlRecord, roll_back_steps, token_digest
from protocols.trajectories import Trajectory


def sample_versions(trajs: Sequence[Trajectory]) -> tuple[list[int], list[int], list[int]]:
    """(min version, max version, loss tokens) of each trajectory's trained tokens (a loss mask's
    zeros are not trained: a workflow's environment tokens). One reduction for an unmasked batch."""
    if any(t.loss_mask is not None for t in trajs):
        vs = [t.model_versions for t in trajs]
        return [int(v.min()) for v in vs], [int(v.max()) for v in vs], [v.numel() for v in vs]
    lens = [t.versions.numel() for t in trajs]
    flat = torch.cat([t.versions for t in trajs]).numpy()  # int32 or int64 (torch.cat promotes a mix)
    starts = np.concatenate(([0], np.cumsum(lens[:-1]))).astype(np.int64)
    return np.minimum.reduceat(flat, starts).tolist(), np.maximum.reduceat(flat, starts).tolist(), lens


def step_line(
    step: int, version: int, trajs: Sequence[Trajectory], skipped: Sequence[int], steps: tuple[int, int]
) -> dict:
    """The record of one step: trajectories in the order trained; ``skipped``: indices of those
    whose minibatch's optimizer step was not applied; ``steps``: (optimizer steps applied, skipped)."""
    vmin, vmax, ntok = sample_versions(trajs)
    out = set(skipped)
    kept = [i for i in range(len(trajs)) if i not in out]
    return {
        "kind": "step",
        "step": step,
        "version": version,
        "ids": [t.sample_id for t in trajs],
        "vmin": vmin,
        "vmax": vmax,
        "n_tokens": ntok,
        "n_out": [t.output_ids.numel() for t in trajs],
        "n_prompt": [t.prompt_ids.numel() for t in trajs],
        "tok_digest": [token_digest(t.output_ids) for t in trajs],
        "scores": [t.score for t in trajs],
        "n_loss_tokens": sum(ntok[i] for i in kept),
        "version_min": min(vmin),
        "version_max": max(vmax),
        "optimizer_steps": steps[0],
        "skipped_minibatches": steps[1],
        "skipped_ids": [trajs[i].sample_id for i in sorted(out)],
        "applied": steps[1] == 0,
    }


class TrainerRecord:
    """``trainer_steps.jsonl`` of one run, continued from ``start_step`` (lines of later steps, from
    an attempt that crashed after its checkpoint, are moved to ``trainer_steps.rolled_back.jsonl``)."""

    def __init__(self, run_dir: str | Path, start_step: int = 0):
        self.rolled_back = roll_back_steps(run_dir, start_step)
        self.file = JsonlRecord(Path(run_dir) / TRAINER_STEPS)

    def step(self, step: int, version: int, trajs: Sequence[Trajectory], skipped: Sequence[int], steps: tuple) -> None:
        self.file.write(step_line(step, version, trajs, skipped, steps))

    def duplicate(self, sample_id: str, message: str) -> None:
        """A sample id that arrived at the buffer again (the copy refused)."""
        self.file.write({"kind": "duplicate", "id": sample_id, "message": message})

    def close(self) -> None:
        self.file.close()
