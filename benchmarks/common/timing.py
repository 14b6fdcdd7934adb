"""Latency statistics and the bounds transfers are compared with: warm single-thread copies.

``Copier.sample`` times one ``copy_`` (and, on CPU, a libc memmove beside it): the bound of
``benchmarks.data_path`` and the ``memcpy_bound`` rows. ``BoundSamples`` is the bound of
``benchmarks.transfer_latency`` (``BOUND_DEF``): per sample the faster of the two, at least
``MIN_BOUND_SAMPLES`` of them taken between the timed transfers of a row, the median the bound."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

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

    def pair(self) -> tuple[float, Optional[float]]:
        """(copy_ seconds, memmove seconds) of one sample, back to back (memmove: None off the CPU)."""
        took = self.sample()
        return took, (self.memcpy[-1] if self.device == "cpu" else None)


MIN_BOUND_SAMPLES = 5  # per row of transfer_latency, also with --quick
BOUND_DEF = (
    "fastest of torch copy_ and libc memmove (np.copyto; CPU only) of {size} between warm buffers, 1 thread, "
    "per sample; the median of >= 5 samples taken between the row's timed transfers"
)


@dataclass
class BoundSamples:
    """The transfer_latency bound of one row: ``(copy_, memmove)`` seconds per sample of ``size`` bytes,
    taken by ``take`` between the row's timed transfers (``slots``: how many places they are taken at,
    so that at least ``MIN_BOUND_SAMPLES`` come out whatever the repeats)."""

    copier: "Copier"
    slots: int
    copy_s: list[float] = field(default_factory=list)
    memmove_s: list[float] = field(default_factory=list)

    def take(self) -> None:
        """This slot's samples: ceil(MIN_BOUND_SAMPLES / slots) of them."""
        for _ in range(math.ceil(MIN_BOUND_SAMPLES / max(self.slots, 1))):
            c, m = self.copier.pair()
            self.copy_s.append(c)
            if m is not None:
                self.memmove_s.append(m)

    def fastest_s(self) -> list[float]:
        return [min(c, m) for c, m in zip(self.copy_s, self.memmove_s)] if self.memmove_s else list(self.copy_s)

    def fields(self, gbps: float) -> dict:
        """The row's bound fields: every sample's GB/s, their median (the bound) and spread ((max - min) /
        median), ``ratio`` = gbps / bound; ``copy_gbps`` and (CPU) ``memmove_gbps`` (medians of each
        alone) and ``ratio_memmove`` = gbps / memmove; the definition, written out."""
        size = self.copier.size
        per = [size / s / 1e9 for s in self.fastest_s()]
        bound = statistics.median(per)
        out = {
            "bound_gbps_samples": [round(x, 3) for x in per],
            "bound_gbps": bound,
            "bound_spread": (max(per) - min(per)) / bound,
            "ratio": gbps / bound,
            "copy_gbps": size / statistics.median(self.copy_s) / 1e9,
            "bound_def": BOUND_DEF.format(size=f"{size} B"),
        }
        if self.memmove_s:
            memmove = size / statistics.median(self.memmove_s) / 1e9
            out |= {"memmove_gbps": memmove, "ratio_memmove": gbps / memmove}
        return out


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
