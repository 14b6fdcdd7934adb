"""Ops shared by the lean Llama/Qwen2 forwards (the rollout engine's ``rollout/engines/kv_decoder.py`` and
the trainer's ``trainer/compute/lean_forward.py``): the same arithmetic as HF's modules, without their
per-call overhead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # rotary frequencies independent of the length


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` without the module call's hook machinery (a few
    microseconds per call, ~15 calls per forward). Subclasses (quantised, LoRA) are called."""
    if type(module) is not torch.nn.Linear:
        return module(x)
    params = module._parameters  # not module.weight: nn.Module.__getattr__ costs ~1.4 us a lookup
    return F.linear(x, params["weight"], params["bias"])


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm: normalise in float32, back to x's dtype, times the weight
    (one fused kernel when all of it is float32)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
