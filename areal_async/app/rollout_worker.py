"""A rollout worker, built from the run directory: the embedded torch engine behind the rollout service."""

from __future__ import annotations

from pathlib import Path

import zmq.asyncio

from areal_async.app.channels import trajectory_channel, weight_channel
from areal_async.app.wiring import control_client, load_run
from areal_async.base.process import set_torch_threads
from areal_async.models.tiny import build_model, load_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.service import RolloutService
from areal_async.rollout.torch_engine import TorchEngine


def build_rollout(run_dir: str | Path, worker_id: str, index: int) -> RolloutService:
    cfg, ep = load_run(run_dir)
    set_torch_threads(cfg.cluster.torch_threads)
    if not cfg.rollout.backend.startswith("torch"):
        raise NotImplementedError(f"rollout.backend={cfg.rollout.backend!r}: only the embedded 'torch' engine "
                                  "is wired into workers yet")
    tok = load_tokenizer(cfg.model.path)
    # The engine starts without weights (version -1); version 0 comes from the trainer.
    if cfg.model.path:
        model = load_model(cfg.model.path, cfg.model.dtype)
    else:
        model = build_model(cfg.model, len(tok), cfg.seed)
    engine = TorchEngine(model, tok, device=cfg.cluster.device, seed=cfg.seed * 1000 + index,
                         max_batch_groups=cfg.rollout.max_batch_groups)
    ctx = zmq.asyncio.Context()
    traj = trajectory_channel(cfg, ep, "sender", rank=index + 1)
    weights = weight_channel(cfg, ep, "receiver", rank=index + 1)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    max_active = max(1, cfg.rollout.max_concurrent_rollouts // cfg.cluster.n_rollout_workers + 1)
    return RolloutService(worker_id, control_client(ctx, cfg, ep, "rollout", worker_id), ctx, engine, decode, traj,
                          weights, ep.rewards, max_active)
