"""Optimizer construction, lr schedules at chosen steps, gradient clipping."""

import math

import pytest
import torch

from areal_async.config import OptimizerConfig
from areal_async.trainer.compute.optim import build_lr_scheduler, build_optimizer, clip_grad_norm, lr_multiplier


def lrs_over(cfg, total, n):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, total, cfg)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_adamw_hyperparameters():
    cfg = OptimizerConfig(lr=2e-5, eps=1e-5, beta1=0.8, beta2=0.95, weight_decay=0.01)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (g["lr"], g["eps"], g["betas"], g["weight_decay"]) == (2e-5, 1e-5, (0.8, 0.95), 0.01)


@pytest.mark.parametrize(
    "kind,want",
    [
        # total 10, warm-up 2 steps, min ratio 0.1: steps 0..10
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0] + [0.1 + 0.9 * (1 - k / 8) for k in range(9)]),
        ("cosine", [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]),
    ],
)
def test_schedules_at_each_step(kind, want):
    cfg = OptimizerConfig(lr=2.0, lr_scheduler_type=kind, warmup_steps_proportion=0.2, min_lr_ratio=0.1)
    assert lrs_over(cfg, total=10, n=11) == pytest.approx([2.0 * w for w in want], abs=1e-9)


def test_schedule_hand_values():
    cfg = OptimizerConfig(lr_scheduler_type="cosine", warmup_steps_proportion=0.2, min_lr_ratio=0.1)
    assert lr_multiplier(4, 10, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)), abs=1e-12)
    assert lr_multiplier(6, 10, cfg) == pytest.approx(0.55, abs=1e-12)
    assert lr_multiplier(50, 10, cfg) == pytest.approx(0.1, abs=1e-12)  # past the end: stays at the floor
    no_warmup = OptimizerConfig(lr_scheduler_type="linear")
    assert lr_multiplier(0, 4, no_warmup) == 1.0 and lr_multiplier(2, 4, no_warmup) == 0.5


def test_bad_schedule_name():
    cfg = OptimizerConfig()
    cfg.lr_scheduler_type = "step"  # OptimizerConfig(lr_scheduler_type="step") itself is refused when built
    with pytest.raises(ValueError, match="'step'"):
        build_lr_scheduler(build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerConfig()), 10, cfg)


def test_clip_grad_norm_returns_norm_and_clips():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], abs=1e-6) and b.grad.tolist() == pytest.approx([0.8], abs=1e-6)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 0.0) == pytest.approx(5.0) and b.grad.tolist() == [4.0]  # 0 disables clipping
