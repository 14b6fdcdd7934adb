"""The trainer worker, built from the run directory: policy (resumed, or built + SFT warm-up), PPO
actor, tensor channels, checkpointer.

With ``cluster.n_trainer_ranks`` = K > 1 (or a model dtype other than float32: mixed precision
needs FSDP2 even on one rank) every rank joins the trainer group, rank 0 alone runs the SFT
warm-up and broadcasts the weights, and each rank shards the policy (float32 master weights,
compute in ``model.dtype``). Rank 0 is the ``TrainerService``; ranks 1..K-1 are ``FollowerRank``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch
import zmq.asyncio

from areal_async.app.workers.channels import trajectory_channel, weight_channel
from areal_async.app.workers.evaluate import PeriodicEvaluator
from areal_async.app.workers.policy import warmup
from areal_async.app.workers.rollout_worker import torch_engine_model
from areal_async.app.workers.wiring import control_client, load_run
from areal_async.base import cores
from areal_async.base.eta import EtaMode
from areal_async.base.process import setup_torch_process
from areal_async.config import ExperimentConfig
from areal_async.models import lora
from areal_async.models.lean_ops import onednn_chosen, use_onednn
from areal_async.models.tiny import load_model, load_policy, save_policy, to_dtype
from areal_async.models.tokenizer import load_tokenizer
from areal_async.reward.pool import RewardPool
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.persist.checkpoint import load_checkpoint, save_checkpoint
from areal_async.trainer.persist.checkpoint_dirs import prune
from areal_async.trainer.persist.final_model import exporter, write_final
from areal_async.trainer.frozen import FrozenActor, weight_schedule
from areal_async.trainer.compute.dp import (
    CMD_EXPORT,
    CMD_SAVE,
    DataParallel,
    broadcast_module,
    init_data_parallel,
    trainer_backend,
)
from areal_async.trainer.compute.packing import select_attn_implementation
from areal_async.trainer.persist.record import TrainerRecord
from areal_async.trainer.persist.recording import Recorder, machine_header
from areal_async.trainer.service import FollowerRank, TrainerService
from areal_async.trainer.persist.sharded_ckpt import export_adapter, export_full, has_shards, load_shards, save_shards

log = logging.getLogger(__name__)


def build_trainer(run_dir: str | Path, worker_id: str, rank: int = 0) -> TrainerService | FollowerRank:
    cfg, ep = load_run(run_dir)
    setup_torch_process(cfg.cluster)
    cores.install_for(run_dir, cfg.cluster, "trainer", rank)  # cluster.share_cores (base/cores.py)
    if cfg.mode == "rollout_only":
        return _frozen_trainer(cfg, ep, run_dir, worker_id)
    resume = ep.resume_from
    dtype = to_dtype(cfg.model.dtype)
    dp = _join_ranks(cfg, ep.trainer_store, rank, dtype)
    sharded = dp.active or dtype != torch.float32
    model, tok, ckpt = _trainer_policy(cfg, resume, rank, sharded)
    if dp.active and ckpt is None:
        broadcast_module(model)  # the warm-up ran on rank 0 only
    spec = lora.LoraSpec.of(cfg.actor.lora)
    if spec is not None:  # the adapter on the frozen initial policy (the same seeded A on every rank)
        if ckpt is None and rank == 0:
            write_lora_base(model, tok, lora_base_dir(run_dir))
        lora.inject(model, spec, cfg.seed)
    actor = make_actor(cfg, model, tok, dp, sharded)
    start_step = start_version = 0
    if ckpt is not None:
        restore_actor(actor, ckpt)
        start_step, start_version = ckpt["step"] + 1, ckpt["version"]
    write_shards = _shard_writer(actor, dtype, spec, str(lora_base_dir(run_dir)))
    export = exporter(actor.model, dtype, rank, spec, str(lora_base_dir(run_dir)))
    if rank > 0:
        return FollowerRank(actor, write_shards, dtype, _bucket_bytes(cfg), export)
    tell = functools.partial(actor.dp.command, CMD_EXPORT, 0)  # the other ranks gather with rank 0
    return _service(
        cfg,
        ep,
        run_dir,
        worker_id,
        actor,
        tok,
        checkpointer=_checkpointer(cfg, run_dir, actor, tok, write_shards),
        start=(start_step, start_version),
        final_model=functools.partial(write_final, run_dir, export, tok, tell),
    )


def _bucket_bytes(cfg: ExperimentConfig) -> int:
    return int(cfg.tensor_channel.bucket_mb * (1 << 20))


def _service(
    cfg, ep, run_dir, worker_id: str, actor, tok, checkpointer, start: tuple[int, int], final_model=None
) -> TrainerService:
    """Rank 0's service around ``actor``: its channels, evaluator and records; ``start``: (step, version);
    ``final_model``: writes RUN_DIR/model after the last step (trainer/persist/final_model.py)."""
    ctx = zmq.asyncio.Context()
    return TrainerService(
        control_client(ctx, cfg, ep, "trainer", worker_id),
        actor,
        trajectory_channel(cfg, ep, "receiver", rank=0),
        weight_channel(cfg, ep, "publisher", rank=0),
        checkpointer=checkpointer,
        start_step=start[0],
        start_version=start[1],
        publish_dtype=to_dtype(cfg.model.dtype),
        bucket_bytes=_bucket_bytes(cfg),
        evaluator=_evaluator(cfg, tok),
        mode=EtaMode.of(cfg),
        total_steps=cfg.total_train_steps,
        forward_ahead_samples=_forward_ahead_samples(cfg, actor),
        # rank 0 holds the whole batch: it alone writes; with the books per sample (areal-async verify)
        record=TrainerRecord(run_dir, start[0]),  # every run: what areal-async verify reads
        recorder=_recorder(cfg, run_dir, start[0]),
        final_model=final_model,
    )


def _frozen_trainer(cfg: ExperimentConfig, ep, run_dir: str | Path, worker_id: str) -> TrainerService:
    """``mode: rollout_only``: version 0 built (and warmed up) as a fleet's, then fixed or scheduled weights
    (``trainer/frozen.py``); no checkpoints (nothing learns)."""
    model, tok, _ = _trainer_policy(cfg, None, 0, False)
    schedule = weight_schedule(cfg.solo.weights) if cfg.solo.weights else []
    actor = FrozenActor(model, schedule, cfg.model.dtype)
    return _service(cfg, ep, run_dir, worker_id, actor, tok, checkpointer=None, start=(0, 0))


def _recorder(cfg: ExperimentConfig, run_dir: str | Path, start_step: int) -> Recorder | None:
    """``rollout.dump_tensors``: every trained batch with its tensors into RUN_DIR/recording
    (trainer/persist/recording.py)."""
    if not cfg.rollout.dump_tensors:
        return None
    linears = ("onednn" if onednn_chosen() else "blas") if cfg.cluster.device == "cpu" else None  # make_actor's choice
    header = machine_header(cfg.cluster.device, cfg.cluster.n_trainer_ranks, cfg.model.dtype, linears)
    return Recorder(run_dir, start_step, header)


def make_actor(cfg: ExperimentConfig, model, tok, dp: DataParallel, sharded: bool) -> PPOActor:
    """The PPO actor of a run's trainer (also what ``replay`` and ``mode: train_only`` train)."""
    dtype = to_dtype(cfg.model.dtype)
    # packed training: per-sequence attention (flash-attn varlen on CUDA) instead of a dense mask
    model.set_attn_implementation(select_attn_implementation(cfg.cluster.device, dtype))
    if cfg.cluster.device == "cpu":  # actor.linears: this process's float32 linears on oneDNN or the BLAS
        hidden = model.config.hidden_size
        dnn = use_onednn(cfg.actor.linears, hidden, getattr(model.config, "intermediate_size", None) or 4 * hidden)
        log.info("trainer linears (actor.linears=%s): %s", cfg.actor.linears, "onednn" if dnn else "blas")
    return PPOActor(
        model,
        cfg.actor,
        temperature=cfg.gconfig.temperature if not cfg.gconfig.greedy else 1.0,
        total_steps=cfg.total_train_steps,
        device=cfg.cluster.device,
        dp=dp,
        compute_dtype=dtype if sharded else None,
        ref_model=lambda: _reference(cfg),
        max_new_tokens=cfg.gconfig.max_new_tokens,
        eos_token_ids=[i for i in [getattr(tok, "eos_token_id", None), *cfg.gconfig.stop_token_ids] if i is not None],
    )


def restore_actor(actor: PPOActor, ckpt: dict) -> None:
    """Weights (fp32 master, from the DCP shards when present) and optimizer, lr schedule and step of a checkpoint
    (``load_checkpoint``'s dict) into ``actor``."""
    if has_shards(ckpt["path"]):
        load_shards(ckpt["path"], actor.model, actor.optimizer)
    actor.load_state_dict(ckpt["actor_state"])


def _forward_ahead_samples(cfg: ExperimentConfig, actor: PPOActor) -> int:
    """A step's samples when its first forward may run ahead (``EtaMode.forward_ahead``: at eta = 0 every
    trajectory the trainer receives while it waits is of its next step) and the actor can; else 0."""
    on = EtaMode.of(cfg).forward_ahead and actor.can_forward_ahead
    return cfg.train_dataset.batch_size * cfg.gconfig.n_samples if on else 0


def _evaluator(cfg: ExperimentConfig, tok) -> PeriodicEvaluator | None:
    """The periodic evaluator (evaluator.freq_steps > 0): a model of its own, as a rollout worker has,
    and a reward pool of its own."""
    if cfg.evaluator.freq_steps == 0:
        return None
    return PeriodicEvaluator(cfg, torch_engine_model(cfg, tok), tok, RewardPool.from_config(cfg.reward))


def _join_ranks(cfg: ExperimentConfig, store: str, rank: int, dtype: torch.dtype) -> DataParallel:
    """This process's trainer rank; a process group only where FSDP2 runs (K > 1 or mixed precision)."""
    world = cfg.cluster.n_trainer_ranks
    if world == 1 and dtype == torch.float32:
        return DataParallel.single()
    if not store:
        raise ValueError(
            "endpoints.json has no 'trainer_store'; expected the supervisor to plan one for "
            f"cluster.n_trainer_ranks={world}"
        )
    return init_data_parallel(rank, world, store, trainer_backend(cfg.cluster.device))


def _trainer_policy(cfg: ExperimentConfig, resume: str | None, rank: int, sharded: bool):
    """(model, tokenizer, checkpoint or None): from the checkpoint when resuming (its DCP shards,
    when present, replace these weights later), else built + SFT warm-up on rank 0 (the warm-up
    makes version 0 and is not repeated on resume). Sharded: float32, the master weights' dtype."""
    if not resume:
        model, tok = load_policy(cfg.model, cfg.seed)
        if rank == 0:
            warmup(cfg, model, tok)
        return model, tok, None
    ckpt = load_checkpoint(resume, restore_rng=True)
    weights = resume if cfg.actor.lora.rank == 0 else lora_base_dir(Path(resume).parents[1])  # run_dir/checkpoints/k
    return load_model(weights, "float32" if sharded else cfg.model.dtype), load_tokenizer(resume), ckpt


def lora_base_dir(run_dir: str | Path) -> Path:
    """Where a LoRA run keeps its frozen base (the initial policy), once: the rollouts load it from there."""
    return Path(run_dir) / lora.LORA_BASE


def write_lora_base(model, tok, path: Path) -> None:
    """The base model and tokenizer as an HF directory, atomically (a temporary directory renamed)."""
    tmp = path.with_name(f".{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_policy(model, tok, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def _reference(cfg: ExperimentConfig) -> torch.nn.Module:
    """The frozen reference policy of the KL penalty (``ref.path``, else the initial policy)."""
    if cfg.ref.path:
        return load_model(cfg.ref.path, cfg.ref.dtype)
    return load_policy(cfg.model, cfg.seed)[0].to(to_dtype(cfg.ref.dtype))


def _shard_writer(actor: PPOActor, dtype: torch.dtype, spec: lora.LoraSpec | None = None, base_dir: str = ""):
    """What every rank writes into a checkpoint directory: its DCP shards, then the HF export
    (gathered; rank 0 writes it in the publish dtype), or a LoRA run's adapter alone (``spec``; its
    base in ``base_dir``)."""

    def write(path: str | Path) -> None:
        save_shards(path, actor.model, actor.optimizer)
        if spec is not None:
            export_adapter(path, actor.model, spec, base_dir, actor.dp.rank)
        else:
            export_full(path, actor.model, dtype, actor.dp.rank)

    return write


def _checkpointer(cfg: ExperimentConfig, run_dir: str | Path, actor: PPOActor, tok, write_shards):
    root = Path(run_dir) / "checkpoints"

    def save(step: int, version: int, state: dict) -> Path:
        def write_model(tmp: Path) -> None:
            actor.dp.command(CMD_SAVE, step, str(tmp))  # the other ranks write their shards there too
            write_shards(tmp)

        path = save_checkpoint(
            root,
            step,
            version,
            actor.model,
            tok,
            actor.state_dict(with_optimizer=False),
            extra=state,
            write_model=write_model,
        )
        prune(root, cfg.saver.keep_last)
        return path

    return save
