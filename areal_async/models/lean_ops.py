"""Ops shared by the lean Llama/Qwen2 forwards (the rollout engine's ``rollout/engines/kv_decoder.py`` and
the trainer's ``trainer/compute/lean_forward.py``): the same arithmetic as HF's modules, without their
per-call overhead."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # rotary frequencies independent of the length


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` without the module call's hook machinery (a few
    microseconds per call, ~15 calls per forward), on oneDNN's matmul where this process chose it
    (``use_onednn``). Subclasses (quantised, LoRA) are called."""
    if type(module) is not torch.nn.Linear:
        return module(x)
    params = module._parameters  # not module.weight: nn.Module.__getattr__ costs ~1.4 us a lookup
    return any_linear(x, params["weight"], params["bias"])


# ---- oneDNN's matmul for float32 CPU linears, forward and backward -----------------------------------------------
# F.linear and autograd's backward matmuls run on the BLAS torch was built with (MKL). On an AMD CPU MKL takes a
# slower path than its Intel one: on this project's AVX-512 AMD machine oneDNN's matmul (the op torch's own mkldnn
# fusions call) took 0.41-0.47 of torch.mm's time at SmolLM2's layer shapes for 1,024-4,096 tokens, for each of
# the three products of a linear's step (Y = X W^T, dX = dY W, dW = dY^T X; docs/performance-notes.md). The
# trainer turns it on per process (actor.linears); it is off by default, so every other caller keeps F.linear.
LINEAR_KERNELS = ("auto", "blas", "onednn")
# oneDNN's primitive cache and ideep's (PyTorch's oneDNN layer) keep 1,024 entries each by default, every one of
# them holding memory; a trainer's micro-batches differ in length, so each makes new shapes (~25: 7 weights x 3
# products, the head). 6 steps of 4 SmolLM2 micro-batches of 400-520 tokens (1 thread, glibc's mmap threshold at
# 1 MiB as the fleet sets it) grew the peak RSS 2.63 -> 3.14 GB, F.linear's 2.56 -> 2.67. At 32 entries, which
# hold one micro-batch's shapes: 2.61 -> 2.74 GB, and no slower (9.6-10.7 s a step; F.linear's 16.5-18.0). Set for
# the process (unless the environment sets them) before its first oneDNN primitive, which reads them.
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 32, "LRU_CACHE_CAPACITY": 32}
_ONEDNN = [False]  # this process's choice (use_onednn)


def onednn_usable(w: torch.Tensor) -> bool:
    """Whether oneDNN's matmul runs a linear of this weight: CPU, float32, a torch built with it."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


@functools.lru_cache(maxsize=None)
def onednn_pays(n_in: int, n_out: int, rows: int = 8) -> bool:
    """Whether oneDNN's matmul on an (n_out, n_in) float32 weight as it is beats ``F.linear``'s by 10 % or more for
    ``rows`` rows on this CPU (the best of 5 interleaved calls each; a few ms, once per shape and process). The BLAS
    behind F.linear differs by CPU: on this session's AVX-512 AMD CPU oneDNN's took 0.43-0.71 of its time at
    SmolLM2's shapes, where on an earlier machine's reordered oneDNN weights were level at 32 rows and slower at 64."""
    if not onednn_usable(torch.empty(0)):
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n_out, n_in, generator=g), torch.randn(rows, n_in, generator=g)
    fns = {"blas": lambda: F.linear(x, w), "onednn": lambda: onednn_mm(x, w)}
    best = {k: float("inf") for k in fns}
    with torch.inference_mode():
        for _ in range(5):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - t)
    return best["onednn"] < 0.9 * best["blas"]


def use_onednn(kernel: str, n_in: int, n_out: int) -> bool:
    """Set this process's linears (``linear``, ``any_linear``) to oneDNN's matmul for ``kernel`` 'onednn', to
    F.linear for 'blas', or, for 'auto', to oneDNN where ``onednn_pays`` at a training micro-batch's rows (512) for
    an (n_out, n_in) weight; returns whether it chose oneDNN. A process-wide switch (as cluster.share_cores is):
    the trainer sets it once, before its first forward."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linears={kernel!r}: expected one of {LINEAR_KERNELS}")
    if kernel != "blas":
        for name, entries in ONEDNN_CACHES.items():
            os.environ.setdefault(name, str(entries))  # read at the first oneDNN primitive: before any is made
    usable = onednn_usable(torch.empty(0))
    if kernel == "onednn" and not usable:
        raise ValueError("linears='onednn': this torch has no oneDNN matmul (torch.ops.mkldnn._linear_pointwise)")
    _ONEDNN[0] = kernel == "onednn" or (kernel == "auto" and onednn_pays(n_in, n_out, rows=512))
    return _ONEDNN[0]


def onednn_chosen() -> bool:
    """Whether this process's linears run on oneDNN (``use_onednn``)."""
    return _ONEDNN[0]


def onednn_mm(x_NK: torch.Tensor, w_MK: torch.Tensor, b_M: torch.Tensor | None = None) -> torch.Tensor:
    """x w^T (+ b) of 2-D float32 CPU tensors on oneDNN's matmul, no autograd; either operand may be a transposed
    view (oneDNN reads the strides: dX and dW need no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x_NK, w_MK, b_M, "none", [], "")


def runs_on_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x w^T`` runs on oneDNN: this process chose it, both float32 on the CPU, at least one row."""
    return _ONEDNN[0] and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0


def mm_t(x_NK: torch.Tensor, w_MK: torch.Tensor, b_M: torch.Tensor | None = None) -> torch.Tensor:
    """x w^T (+ b) of 2-D tensors, no autograd (inside an autograd function's forward or backward): on
    ``onednn_mm`` where this process chose oneDNN and both are float32 CPU tensors, else F.linear's."""
    if runs_on_onednn(x_NK, w_MK):
        return onednn_mm(x_NK, w_MK, b_M)
    return F.linear(x_NK, w_MK, b_M)


def any_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, with autograd; on oneDNN's matmul where this process chose it and it can."""
    if runs_on_onednn(x, w):
        return _OneDNNLinear.apply(x, w, b)
    return F.linear(x, w, b)


class _OneDNNLinear(torch.autograd.Function):
    """A linear whose three products run on ``onednn_mm``: the same saved tensors as F.linear's (x, w)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.with_bias = b is not None
        return onednn_mm(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g_NM = g.reshape(-1, g.shape[-1])
        dx = onednn_mm(g_NM, w.t()).view(x.shape) if need_x else None
        dw = onednn_mm(g_NM.t(), x.reshape(-1, x.shape[-1]).t()) if need_w else None
        db = g_NM.sum(0) if need_b and ctx.with_bias else None
        return dx, dw, db


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm: normalise in float32, back to x's dtype, times the weight
    (one fused kernel when all of it is float32)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
