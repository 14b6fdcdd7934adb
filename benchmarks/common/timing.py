"""Latency statistics and the bound every transfer is compared with: one warm single-thread copy."""

from __future__ import annotations

import time

import numpy as np
import torch


def stats(samples: list[float]) -> dict:
    """``p50_s`` and ``p99_s`` of latency samples (seconds); with few samples p99 is ~ the max."""
    if not samples:
        raise ValueError("stats of no samples: at least one latency sample is needed")
    return {"p50_s": float(np.percentile(samples, 50)), "p99_s": float(np.percentile(samples, 99))}


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a timestamp means 'done'."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Copier:
    """The bound: one single-threaded copy of ``size`` bytes between two warm buffers.

    Sample it right before every transfer sample, so load from other processes on a shared machine
    hits the bound and the channel alike and their ratio stays meaningful."""

    def __init__(self, size: int, device: str):
        self.size, self.device = size, device
        self.src = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device).fill_(1.0)
        self.dst = torch.zeros_like(self.src)
        self.dst.copy_(self.src)
        self.memcpy: list[float] = []  # CPU: seconds of a libc memmove of the same bytes, one per sample

    def sample(self) -> float:
        """Seconds of one copy (``copy_``); on CPU also times a libc memmove (``np.copyto``) into
        ``memcpy``: a second bound, as fast as a copy gets here on one thread (glibc's large copies
        skip reading the destination; torch's ``copy_`` loop does not). Both before the transfer."""
        sync(self.device)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        sync(self.device)
        took = time.perf_counter() - t0
        if self.device == "cpu":
            t0 = time.perf_counter()
            np.copyto(self.dst.numpy(), self.src.numpy())
            self.memcpy.append(time.perf_counter() - t0)
        return took

    def gbps(self, samples: list[float]) -> float:
        """GB/s of the median sample."""
        return self.size / stats(samples)["p50_s"] / 1e9


def memcpy_seconds(size: int, device: str, repeats: int) -> list[float]:
    c = Copier(size, device)
    return [c.sample() for _ in range(repeats)]


def memcpy_row(size: int, samples: list[float], device: str) -> dict:
    """The bound alone as a row (``memcpy_bound``, GB/s of the median copy of ``size`` bytes)."""
    st = stats(samples)
    return {
        "metric": "memcpy_bound",
        "value": size / st["p50_s"] / 1e9,
        "unit": "GB/s",
        "bytes": size,
        **st,
        "device": device,
        "how": "dst.copy_(src), warm buffers, 1 thread" if device == "cpu" else "device-to-device copy_",
    }
