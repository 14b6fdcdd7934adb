"""``mode: rollout_only``: the trainer's place in the fleet taken by weights that do not learn.

``FrozenActor`` has the face of ``PPOActor`` that ``TrainerService`` uses: ``train_step`` takes the
planned batch and trains nothing (it only measures it: sequences, tokens, score), the version still
advances one per step, and ``publish_state`` hands the weights of the new version to the weight channel,
so the rollouts pause, load and resume as in a fleet. The weights of version v are version 0 (fixed),
or with a schedule the newest checkpoint of a previous run whose version is <= v (``solo.weights``).
Scheduler, rollouts, reward and metrics.jsonl run unchanged: a row's ``train_s`` is then ~0 and its
``step_s`` is what generation and reward alone take per step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from areal_async.models.tiny import load_model
from areal_async.trainer.persist.checkpoint_dirs import COMPLETE
from areal_async.trainer.compute.dp import DataParallel
from protocols.trajectories import Trajectory

log = logging.getLogger("areal_async.trainer")


def weight_schedule(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(version, checkpoint dir) of every complete checkpoint of ``run_dir``, by version; ValueError when none."""
    out = []
    for d in Path(run_dir, "checkpoints").glob("step_*"):
        if (d / COMPLETE).is_file():
            out.append((int(json.loads((d / "meta.json").read_text())["version"]), d))
    if not out:
        raise ValueError(f"solo.weights={str(run_dir)!r}: no complete checkpoint under {run_dir}/checkpoints")
    return sorted(out)


class FrozenActor:
    """Weights that do not learn, published as versions 0, 1, 2, ... (see the module docstring)."""

    can_forward_ahead = False
    sharded = False

    def __init__(self, model: torch.nn.Module, schedule: Sequence[tuple[int, Path]] = (), dtype: str = "float32"):
        """``model``: version 0. ``schedule``: (version, checkpoint dir) ascending; empty = fixed weights."""
        self.model, self.schedule, self.dtype = model, list(schedule), dtype
        self.dp = DataParallel.single()
        self.step = 0
        self.skipped_indices: list[int] = []
        self._loaded: Optional[Path] = None  # the checkpoint whose weights self.model holds (None: version 0)

    def train_step(self, trajs: Sequence[Trajectory], ahead=None) -> dict[str, float]:
        """Count the batch, train nothing; the next version follows."""
        if not trajs:
            raise ValueError("train_step got no trajectories; expected a non-empty batch")
        self.step += 1
        n_tokens = sum(t.output_ids.numel() for t in trajs)
        return {
            "n_seqs": float(len(trajs)),
            "n_tokens": float(n_tokens),
            "score_mean": sum(t.score for t in trajs) / len(trajs),
            "optimizer_steps": 0.0,
            "skipped_steps": 0.0,
            "step": float(self.step),
        }

    def source(self, version: int) -> Optional[Path]:
        """The checkpoint whose weights stand for ``version`` (None: version 0's)."""
        src = None
        for v, path in self.schedule:
            if v <= version:
                src = path
        return src

    def publish_state(self, dtype: torch.dtype, bucket_bytes: int) -> dict[str, torch.Tensor]:
        """The weights of version ``self.step`` in ``dtype``."""
        src = self.source(self.step)
        if src is not None and src != self._loaded:
            log.info("rollout_only: version %d takes the weights of %s", self.step, src)
            self.model.load_state_dict(load_model(src, self.dtype).state_dict())
            self._loaded = src
        return {
            k: v.detach() if not v.is_floating_point() or v.dtype == dtype else v.detach().to(dtype)
            for k, v in self.model.state_dict().items()
        }

    def state_dict(self, with_optimizer: bool = True) -> dict:
        return {"step": self.step}
