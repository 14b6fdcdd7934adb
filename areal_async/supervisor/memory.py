"""Peak resident memory of each worker process, for ``summary.json`` (``peak_rss_mb``).

The supervisor reads ``VmHWM`` (the kernel's high-water mark of the resident set, the figure
``getrusage``'s ``ru_maxrss`` reports to the process itself) from ``/proc/PID/status`` of each
child it started, about once a second, keeping the largest per worker name (a restarted worker's
incarnations share one entry). A high-water mark only grows, so sampling misses nothing but what a
process adds in its last second. Only processes on this machine (the local launcher and the
loopback nodes): a Ray or Slurm worker elsewhere has no entry. A worker's own children (the reward
pool's scoring processes, an SGLang/vLLM server) are not included in its figure.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional


def vm_hwm_kb(pid: Optional[int]) -> Optional[int]:
    """The process' peak resident set in KiB, or None (not on this machine, exited, no such line)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class PeakRss:
    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self.peak_kb: dict[str, int] = {}
        self._last = float("-inf")

    def sample(self, children: Iterable, now: Optional[float] = None) -> None:
        """``children``: objects with ``name`` and ``proc.pid``; at most once every ``every_s``."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.every_s:
            return
        self._last = now
        for c in children:
            kb = vm_hwm_kb(getattr(c.proc, "pid", None))
            if kb is not None:
                self.peak_kb[c.name] = max(kb, self.peak_kb.get(c.name, 0))

    def mb(self) -> dict[str, float]:
        """Worker name -> peak RSS in MiB (1 decimal), by name."""
        return {name: round(kb / 1024, 1) for name, kb in sorted(self.peak_kb.items())}
