"""``mode: train_only``: the trainer alone, in this process, on the recording of another run (``solo.recording``).

No scheduler, rollout or reward process: each recorded step is read from disk (its seconds are the
row's ``wait_data_s``) and trained (``train_s``, ``train_cpu_s``) by the actor a fleet's trainer would
build from this config, starting from the recording run's checkpoint of the first recorded step's
version when it has one, else from this config's version 0 (built and warmed up). No weights are
published (``publish_s`` 0). ``metrics.jsonl`` gets the fleet's columns (step, version, reward_mean,
staleness_*, samples_trained(_total), step_s, wall_s, plan_wait_s, the trainer's metrics), so a
train-only run and a fleet run of the same config read side by side (``areal-async plot`` too).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from areal_async.app.workers.policy import warmup
from areal_async.app.commands.replay import build_actor, checkpoint_of_version, train_recorded
from areal_async.app.workers.trainer_worker import make_actor
from areal_async.base.process import setup_torch_process
from areal_async.config import ExperimentConfig, to_yaml
from areal_async.models.tiny import load_policy
from areal_async.scheduler.runlog import RunLog
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.dp import DataParallel
from areal_async.trainer.persist.recording import (
    RecordedStep,
    RecordingError,
    read_header,
    read_step,
    recorded_steps,
    step_path,
)

__all__ = ["RecordingError", "run_train_only", "start_actor", "fleet_columns"]

log = logging.getLogger("areal_async.train_only")


def start_actor(cfg: ExperimentConfig, source: Path, first: int) -> PPOActor:
    """From the source run's checkpoint of version ``first``, else this config's version 0."""
    ckpt = checkpoint_of_version(source, first) if first > 0 else None
    if ckpt is not None:
        return build_actor(cfg, ckpt)
    if first > 0:
        log.warning("train_only: %s has no checkpoint of version %d; starting from version 0", source, first)
    model, tok = load_policy(cfg.model, cfg.seed)
    warmup(cfg, model, tok)
    actor = make_actor(cfg, model, tok, DataParallel.single(), sharded=False)
    actor.step = first  # the recorded steps' numbers (and the lr schedule's position)
    for _ in range(first):
        actor.lr_scheduler.step()
    return actor


def fleet_columns(rec: RecordedStep, total: int) -> dict:
    """The scheduler's columns of a metrics row that a recorded batch determines."""
    vmin = [int(t.model_versions.min()) for t in rec.trajs]
    return {
        "step": rec.step,
        "version": rec.version,
        "reward_mean": sum(t.score for t in rec.trajs) / len(rec.trajs),
        "staleness_max": max(rec.step - v for v in vmin),
        "staleness_mean": sum(rec.step - v for v in vmin) / len(vmin),
        "samples_trained": len(rec.trajs),
        "samples_trained_total": total,
        "plan_wait_s": 0.0,
    }


def run_train_only(cfg: ExperimentConfig, run_dir: str | Path) -> int:
    """Train every recorded step of ``cfg.solo.recording`` (at most ``total_train_steps``); exit code."""
    source, run_dir = Path(cfg.solo.recording), Path(run_dir)
    header = read_header(source)
    steps = recorded_steps(source)[: cfg.total_train_steps]
    if not steps:
        raise RecordingError(f"{source}: the recording holds no step")
    setup_torch_process(cfg.cluster)  # threads and heap as a fleet's trainer has them
    if header.get("torch_threads") != torch.get_num_threads():
        log.warning(
            "train_only: recorded with %s torch threads, training with %d",
            header.get("torch_threads"),
            torch.get_num_threads(),
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    actor = start_actor(cfg, source, steps[0])
    books, t0, total = RunLog(run_dir, False), time.time(), 0
    for s in steps:
        t = time.perf_counter()
        rec = read_step(step_path(source, s))
        t1, c1 = time.perf_counter(), time.thread_time()
        metrics = train_recorded(actor, rec) if actor.step == rec.step else actor.train_step(rec.trajs)
        t2, total = time.perf_counter(), total + len(rec.trajs)
        row = fleet_columns(rec, total) | {"step_s": t2 - t, "wall_s": time.time() - t0}
        row |= {"wait_data_s": t1 - t, "train_s": t2 - t1, "train_cpu_s": time.thread_time() - c1, "publish_s": 0.0}
        books.metrics(row | {k: float(v) for k, v in metrics.items() if k not in row})
        log.info("train_only: step %d in %.3f s (train %.3f s)", s, t2 - t, t2 - t1)
    books.summary({"mode": "train_only", "recording": str(source), "steps": len(steps), "wall_s": time.time() - t0})
    books.close()
    return 0
