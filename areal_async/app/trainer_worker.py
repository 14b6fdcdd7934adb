"""The trainer worker, built from the run directory: policy (resumed, or built + SFT warm-up), PPO
actor, tensor channels, checkpointer."""

from __future__ import annotations

from pathlib import Path

import zmq.asyncio

from areal_async.app.channels import trajectory_channel, weight_channel
from areal_async.app.wiring import control_client, load_run
from areal_async.base.process import set_torch_threads
from areal_async.config import ExperimentConfig
from areal_async.data.prompts import keep_short, load_problems, prompt_encoder, sft_examples
from areal_async.models.tiny import load_model, load_policy
from areal_async.models.tokenizer import load_tokenizer
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.checkpoint import load_checkpoint, save_checkpoint
from areal_async.trainer.checkpoint_dirs import prune
from areal_async.trainer.packing import select_attn_implementation
from areal_async.trainer.service import TrainerService
from areal_async.trainer.sft import SFTTrainer


def build_trainer(run_dir: str | Path, worker_id: str) -> TrainerService:
    cfg, ep = load_run(run_dir)
    set_torch_threads(cfg.cluster.torch_threads)
    resume = ep.extra.get("resume_from")
    model, tok, ckpt = _trainer_policy(cfg, resume)
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
    return TrainerService(control_client(ctx, cfg, ep, "trainer", worker_id), actor, traj, weights,
                          checkpointer=_checkpointer(cfg, run_dir, actor, tok), start_step=start_step,
                          start_version=start_version)


def _trainer_policy(cfg: ExperimentConfig, resume: str | None):
    """(model, tokenizer, checkpoint or None): from the checkpoint when resuming, else built +
    SFT warm-up (the warm-up makes version 0 and is not repeated on resume)."""
    if not resume:
        model, tok = load_policy(cfg.model, cfg.seed)
        warmup(cfg, model, tok)
        return model, tok, None
    ckpt = load_checkpoint(resume, restore_rng=True)
    return load_model(resume, cfg.model.dtype), load_tokenizer(resume), ckpt


def _checkpointer(cfg: ExperimentConfig, run_dir: str | Path, actor, tok):
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
    d = cfg.train_dataset
    problems = load_problems(d, cfg.seed)
    kept = keep_short(problems, prompt_encoder(tok, d.template), d.max_prompt_len).kept
    examples = sft_examples([problems[i] for i in kept], tok, d.template)
    if not examples:
        raise ValueError("sft_warmup.steps > 0 but the training dataset has no 'answer' fields to imitate")
    return SFTTrainer(model, cfg.sft_warmup, cfg.actor.mb_spec.max_tokens_per_mb, seed=cfg.seed).run(examples)
