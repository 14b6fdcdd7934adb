"""Build each worker from the run directory: the logic behind the thin ``workers/`` entry points.

Every builder reads ``RUN_DIR/config.yaml`` and ``RUN_DIR/endpoints.json`` (written by the
supervisor) and returns an object whose ``run()`` coroutine is the worker's life.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq.asyncio

from areal_async.config import ExperimentConfig, ModelConfig
from areal_async.data.prompts import prompt_encoder  # noqa: F401  (re-exported: sft_run, tests import it here)
from areal_async.runtime.control import ControlClient
from areal_async.runtime.fleet import Endpoints, load_run, set_torch_threads


def load_tokenizer(cfg: ModelConfig):
    if cfg.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
    from areal_async.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def _control(ctx, cfg: ExperimentConfig, ep: Endpoints, role: str, worker_id: str) -> ControlClient:
    return ControlClient(ctx, ep.control, role, worker_id, cfg.cluster.heartbeat_s)


def supervisor_t0() -> float:
    return float(os.environ.get("AREAL_T0", time.time()))


def _group(cfg: ExperimentConfig, ep: Endpoints, kind: str, rank: int, store_key: str) -> dict:
    """Rank/world/store for the collective kinds (rank 0 = trainer, 1..N = rollout workers)."""
    if kind not in ("gloo", "nccl"):
        return {}
    return {"rank": rank, "world_size": cfg.cluster.n_rollout_workers + 1, "store": ep.extra[store_key]}


def trajectory_channel(cfg: ExperimentConfig, ep: Endpoints, role: str, rank: int):
    from areal_async.transport import make_tensor_channel

    kind = cfg.tensor_channel.trajectories
    kw = {"run_id": ep.extra.get("run_id")} if kind == "shm" else {}
    return make_tensor_channel(kind, role=role, endpoint=ep.trajectories, **kw,
                               **_group(cfg, ep, kind, rank, "traj_store"))


def weight_channel(cfg: ExperimentConfig, ep: Endpoints, role: str, rank: int):
    from areal_async.transport import make_weight_channel

    kind = cfg.tensor_channel.weights
    kw = {"run_id": ep.extra.get("run_id")} if kind == "shm" else {}
    if role == "publisher":
        kw["bucket_mb"] = cfg.tensor_channel.bucket_mb
        if kind == "zmq":
            kw["endpoint"] = ep.extra["weights_endpoint"]
    return make_weight_channel(kind, role=role, **kw, **_group(cfg, ep, kind, rank, "weight_store"))


def build_scheduler(run_dir: str | Path):
    from areal_async.scheduler.service import SchedulerService

    cfg, ep = load_run(run_dir)
    return SchedulerService(cfg, ep, run_dir, supervisor_t0(), prompt_encoder(load_tokenizer(cfg.model)))


def build_reward(run_dir: str | Path, worker_id: str, index: int):
    from areal_async.reward.pool import RewardPool
    from areal_async.reward.service import RewardService

    cfg, ep = load_run(run_dir)
    pool = RewardPool.from_config(cfg.reward)
    ctx = zmq.asyncio.Context()
    return RewardService(worker_id, _control(ctx, cfg, ep, "reward", worker_id), ctx, ep.rewards[index], pool,
                         cfg.reward.n_procs)


def build_rollout(run_dir: str | Path, worker_id: str, index: int):
    from areal_async.models.tiny import build_model, load_model
    from areal_async.rollout.service import RolloutService
    from areal_async.rollout.torch_engine import TorchEngine

    cfg, ep = load_run(run_dir)
    set_torch_threads(cfg.cluster.torch_threads)
    if not cfg.rollout.backend.startswith("torch"):
        raise NotImplementedError(f"rollout.backend={cfg.rollout.backend!r}: only the embedded 'torch' engine is wired into workers yet")
    tok = load_tokenizer(cfg.model)
    # The engine starts without weights (version -1); version 0 comes from the trainer.
    model = load_model(cfg.model.path, cfg.model.dtype) if cfg.model.path else build_model(cfg.model, len(tok), cfg.seed)
    engine = TorchEngine(model, tok, device=cfg.cluster.device, seed=cfg.seed * 1000 + index,
                         max_batch_groups=cfg.rollout.max_batch_groups)
    ctx = zmq.asyncio.Context()
    traj = trajectory_channel(cfg, ep, "sender", rank=index + 1)
    weights = weight_channel(cfg, ep, "receiver", rank=index + 1)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    max_active = max(1, cfg.rollout.max_concurrent_rollouts // cfg.cluster.n_rollout_workers + 1)
    return RolloutService(worker_id, _control(ctx, cfg, ep, "rollout", worker_id), ctx, engine, decode, traj, weights,
                          ep.rewards, max_active)


def build_trainer(run_dir: str | Path, worker_id: str):
    from areal_async.trainer.actor import PPOActor
    from areal_async.trainer.service import TrainerService

    cfg, ep = load_run(run_dir)
    set_torch_threads(cfg.cluster.torch_threads)
    resume = ep.extra.get("resume_from")
    model, tok, ckpt = _trainer_policy(cfg, resume)
    from areal_async.trainer.packing import select_attn_implementation

    # packed training: per-sequence attention (flash-attn varlen on CUDA) instead of a dense mask
    model.set_attn_implementation(select_attn_implementation(cfg.cluster.device))
    actor = PPOActor(model, cfg.actor, temperature=cfg.gconfig.temperature if not cfg.gconfig.greedy else 1.0,
                     total_steps=cfg.total_train_steps, device=cfg.cluster.device)
    start_step = start_version = 0
    if ckpt is not None:
        actor.load_state_dict(ckpt["actor_state"])
        start_step, start_version = ckpt["step"] + 1, ckpt["version"]
    ctx = zmq.asyncio.Context()
    traj = trajectory_channel(cfg, ep, "receiver", rank=0)
    weights = weight_channel(cfg, ep, "publisher", rank=0)
    return TrainerService(_control(ctx, cfg, ep, "trainer", worker_id), actor, traj, weights,
                          checkpointer=_checkpointer(cfg, run_dir, actor, tok), start_step=start_step,
                          start_version=start_version)


def _trainer_policy(cfg: ExperimentConfig, resume: str | None):
    """(model, tokenizer, checkpoint or None): from the checkpoint when resuming, else built +
    SFT warm-up (the warm-up makes version 0 and is not repeated on resume)."""
    from areal_async.models.tiny import load_model, load_policy

    if not resume:
        model, tok = load_policy(cfg.model, cfg.seed)
        warmup(cfg, model, tok)
        return model, tok, None
    from transformers import AutoTokenizer

    from areal_async.trainer.checkpoint import load_checkpoint

    ckpt = load_checkpoint(resume, restore_rng=True)
    tok = AutoTokenizer.from_pretrained(resume, local_files_only=True)
    return load_model(resume, cfg.model.dtype), tok, ckpt


def _checkpointer(cfg: ExperimentConfig, run_dir: str | Path, actor, tok):
    from areal_async.trainer.checkpoint import prune, save_checkpoint

    root = Path(run_dir) / "checkpoints"

    def save(step: int, version: int, state: dict) -> Path:
        path = save_checkpoint(root, step, version, actor.model, tok, actor.state_dict(), extra=state)
        prune(root, cfg.saver.keep_last)
        return path

    return save


def warmup(cfg: ExperimentConfig, model, tok) -> list[dict]:
    """The optional SFT warm-up that makes the initial weights (version 0)."""
    if cfg.sft_warmup.steps == 0:
        return []
    from areal_async.data.prompts import load_problems, sft_examples
    from areal_async.trainer.sft import SFTTrainer

    examples = sft_examples(load_problems(cfg.train_dataset, cfg.seed), tok)
    if not examples:
        raise ValueError("sft_warmup.steps > 0 but the training dataset has no 'answer' fields to imitate")
    return SFTTrainer(model, cfg.sft_warmup, cfg.actor.mb_spec.max_tokens_per_mb, seed=cfg.seed).run(examples)
