"""A reward worker, built from the run directory (no torch here: its checking children stay light)."""

from __future__ import annotations

from pathlib import Path

import zmq.asyncio

from areal_async.app.workers.wiring import control_client, load_run
from areal_async.base.records import RewardRecord
from areal_async.reward.pool import RewardPool
from areal_async.reward.samples import RewardSampleLog
from areal_async.reward.service import RewardService


def build_reward(run_dir: str | Path, worker_id: str, index: int) -> RewardService:
    cfg, ep = load_run(run_dir)
    pool = RewardPool.from_config(cfg.reward)
    ctx = zmq.asyncio.Context()
    return RewardService(
        worker_id,
        control_client(ctx, cfg, ep, "reward", worker_id),
        ctx,
        ep.rewards[index],
        pool,
        cfg.reward.n_procs,
        RewardSampleLog(run_dir, worker_id),
        RewardRecord(run_dir, worker_id),
    )
