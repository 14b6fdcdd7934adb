"""AdamW, learning-rate schedules with linear warm-up, and gradient clipping.

Covered: AdamW from ``OptimizerConfig`` (lr, eps, betas, weight decay); schedules 'constant',
'linear' and 'cosine' decaying to ``min_lr_ratio * lr`` after ``warmup_steps_proportion *
total_steps`` warm-up steps; global-norm clipping that always returns the norm.

Schedule convention (0-based step s, W warm-up steps, S total steps):
- s < W: lr * (s + 1) / W  (the first step already trains, at lr / W);
- after: progress p = (s - W) / max(1, S - W) clamped to [0, 1]; constant 1, linear
  m + (1 - m)(1 - p), cosine m + (1 - m)(1 + cos(pi p)) / 2, with m = min_lr_ratio.
The actor advances the schedule once per trainer step (all PPO minibatches of a step share
one lr), so S is the number of trainer steps.

Not covered: ZeRO/FSDP sharded optimizers (the GPU trainer wraps these objects).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from areal_async.config import LR_SCHEDULES, OptimizerConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        list(params), lr=cfg.lr, eps=cfg.eps, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
    )


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Factor applied to the peak lr at 0-based step ``step`` (see the module docstring)."""
    if cfg.lr_scheduler_type not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type!r}: expected one of {LR_SCHEDULES}")
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    p = min(max((step - warmup) / max(1, total_steps - warmup), 0.0), 1.0)
    m = cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        return m + (1 - m) * (1 - p)
    if cfg.lr_scheduler_type == "cosine":
        return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))
    return 1.0


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over ``lr_multiplier``. A plain closure on purpose: LambdaLR then keeps only the
    step counters in its state_dict (plain ints, safe for ``torch.load(weights_only=True)``) and
    a restored run takes the schedule's shape from its own config."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: expected an integer >= 1")
    lr_multiplier(0, total_steps, cfg)  # fail now, not at the first step, on a bad schedule name

    def multiplier(step: int) -> float:
        return lr_multiplier(step, total_steps, cfg)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global L2 grad norm to max_norm (0 disables clipping) and return the norm before it.

    FSDP2 parameters (DTensor shards): the norm is over the whole model, gathered from every rank."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    # an infinite max_norm clips nothing (the coefficient is clamped to 1) but still returns the norm
    total = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"))
    return float(total.full_tensor() if hasattr(total, "full_tensor") else total)
