"""Peak resident memory of each worker process, for ``summary.json`` (``peak_rss_mb``).

The supervisor reads ``VmHWM`` (the kernel's high-water mark of the resident set, the figure
``getrusage``'s ``ru_maxrss`` reports to the process itself) from ``/proc/PID/status`` of each
child it started, about once a second, keeping the largest per worker name (a restarted worker's
incarnations share one entry). A high-water mark only grows, so sampling misses nothing but what a
process adds in its last second. Only processes on this machine (the local launcher and the
loopback nodes): a Ray or Slurm worker elsewhere has no entry. A worker's own children (the reward
pool's scoring processes, an SGLang/vLLM server) are not included in its figure.

Beside it, ``peak_rss_parts_mb``: the largest ``RssAnon`` (the process's own memory: heap, tensors)
and ``RssShmem`` (shared-memory pages it maps: the weight channel's /dev/shm segments, which the
trainer and the rollout workers map in turn and /dev/shm holds once for all of them) seen in the
same samples. These are sampled, so a peak shorter than a second may be missed; the two maxima may
come from different moments, so they need not add up to ``peak_rss_mb``.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional


_FIELDS = ("VmHWM", "RssAnon", "RssShmem")


def status_kb(pid: Optional[int]) -> dict[str, int]:
    """``VmHWM``, ``RssAnon`` and ``RssShmem`` of the process in KiB, those it has ({} when it is not on
    this machine or has exited)."""
    if not pid:
        return {}
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _FIELDS:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def vm_hwm_kb(pid: Optional[int]) -> Optional[int]:
    """The process' peak resident set in KiB, or None (not on this machine, exited, no such line)."""
    return status_kb(pid).get("VmHWM")


class PeakRss:
    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self.peak_kb: dict[str, int] = {}
        self.parts_kb: dict[str, dict[str, int]] = {}  # name -> {"anon", "shmem"}: the largest sampled
        self._last = float("-inf")

    def sample(self, children: Iterable, now: Optional[float] = None) -> None:
        """``children``: objects with ``name`` and ``proc.pid``; at most once every ``every_s``."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.every_s:
            return
        self._last = now
        for c in children:
            kb = status_kb(getattr(c.proc, "pid", None))
            if "VmHWM" in kb:
                self.peak_kb[c.name] = max(kb["VmHWM"], self.peak_kb.get(c.name, 0))
            parts = self.parts_kb.setdefault(c.name, {})
            for key, part in (("RssAnon", "anon"), ("RssShmem", "shmem")):
                if key in kb:
                    parts[part] = max(kb[key], parts.get(part, 0))

    def mb(self) -> dict[str, float]:
        """Worker name -> peak RSS in MiB (1 decimal), by name."""
        return {name: round(kb / 1024, 1) for name, kb in sorted(self.peak_kb.items())}

    def parts_mb(self) -> dict[str, dict[str, float]]:
        """Worker name -> {"anon", "shmem"}: the largest sampled of each in MiB (1 decimal)."""
        return {
            name: {part: round(kb / 1024, 1) for part, kb in sorted(parts.items())}
            for name, parts in sorted(self.parts_kb.items())
            if parts
        }
