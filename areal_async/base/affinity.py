"""CPU pinning of worker processes (``cluster.cpu_affinity``), Linux cpu-list syntax.

Why: on a machine with few cores, the trainer (the bottleneck of an async pipeline whenever
t_train >= t_gen) loses time slices to decoding, reward checks and message handling bursts; a
core of its own is what it gets on a GPU cluster anyway (its own devices). Pinning is opt-in.

Covered: ``parse_cpu_list`` ("0", "0-3", "0,2,5-7"; clear ValueError otherwise),
``check_available`` (every CPU must be in this process's allowed set), ``pin_self``.
Not covered: NUMA memory binding, hyperthread sibling awareness.
"""

from __future__ import annotations

import os


def parse_cpu_list(spec: str) -> set[int]:
    """'0,2-4' -> {0, 2, 3, 4}. Raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            raise ValueError(f"cpu list {spec!r}: {part!r} is not N or N-M (expected e.g. '0', '1-3', '0,2')")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"cpu list {spec!r}: range {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    return cpus


def check_available(spec: str, where: str = "cpu list") -> set[int]:
    """The parsed CPUs, or ValueError if some are not usable by this process."""
    cpus = parse_cpu_list(spec)
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(
            f"{where}={spec!r}: CPU(s) {missing} are not available here (this process may use {sorted(allowed)})"
        )
    return cpus


def pin_self(spec: str) -> set[int]:
    """Pin the calling process (its current and future threads and children) to ``spec``."""
    cpus = check_available(spec)
    os.sched_setaffinity(0, cpus)
    return cpus
