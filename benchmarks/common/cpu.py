"""CPU accounting from /proc (Linux): per pid, per process tree, per fleet role, and machine-wide.

- ``proc_cpu_s`` / ``tree_cpu``: user + system CPU seconds of a live pid / of every live process
  under a root pid.
- ``TreeCPU``: a thread sampling a tree every ``period_s`` seconds, summed per role (``fleet_role``
  by default: scheduler, trainer, rollout-i, reward-i, reward-pool, fork-server, supervisor), together with a
  progress count (e.g. metrics rows written so far); ``cpu_per_step`` turns its samples into CPU
  seconds per step over a steady window.
- ``cpu_busy_s`` (all processes, /proc/stat), ``own_cpu_s`` (this process and its reaped
  children) and ``wait_quiet``: how busy the rest of the machine is.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path
from typing import Callable, Optional

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> Optional[tuple[int, float]]:
    """(parent pid, user + system CPU seconds) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_s(pid: int) -> Optional[float]:
    """User + system CPU seconds of a live process, None if it is gone."""
    st = proc_stat(pid)
    return None if st is None else st[1]


def tree_cpu(root: int) -> dict[int, float]:
    """{pid: CPU seconds} of ``root`` and every live descendant."""
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := proc_stat(int(d))) is not None}
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return out


def fleet_role(pid: int) -> Optional[str]:
    """An areal-async process's role from its command line: its --worker-id, reward-pool, supervisor
    or "other"; None when there is no command line to read (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            argv = f.read().split("\0")
    except OSError:
        return None
    if argv == [""]:
        return None
    if "--worker-id" in argv[:-1]:
        return argv[argv.index("--worker-id") + 1]
    if "areal_async.reward._child" in argv:
        return "reward-pool"
    if "areal_async.supervisor.zygote" in argv:
        return "fork-server"
    return "supervisor" if _is_supervisor(argv) else "other"


def _is_supervisor(argv: list[str]) -> bool:
    """``python -m areal_async.cli ...`` or the ``areal-async`` console script (its file name, not any
    path that merely contains the word: a checkout in a folder named areal-async is not a supervisor)."""
    return "areal_async.cli" in argv or any(os.path.basename(a) == "areal-async" for a in argv[:2])


def count_lines(path: Path) -> int:
    """Lines in a file so far (0 when it does not exist yet): a progress count for ``TreeCPU``."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


class TreeCPU(threading.Thread):
    """Samples, every period_s, the CPU seconds of each role in a process tree together with a
    progress count: ``samples`` = [(progress, {role: CPU s})] for `cpu_per_step`. A process that
    exited keeps its last reading (up to period_s of its final CPU is missed)."""

    def __init__(
        self,
        root_pid: int,
        progress: Callable[[], int],
        period_s: float = 0.5,
        role: Callable[[int], Optional[str]] = fleet_role,
    ):
        super().__init__(name="tree-cpu", daemon=True)
        self.root, self.progress, self.period_s, self.role_of = root_pid, progress, period_s, role
        self.samples: list[tuple[int, dict[str, float]]] = []
        self.roles: dict[int, str] = {}  # pid -> role at its last readable command line
        self.last: dict[int, float] = {}  # pid -> CPU seconds at its last reading
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            self.samples.append((self.progress(), self.sample()))

    def sample(self) -> dict[str, float]:
        """{role: CPU s} of every process seen under the root so far; one that exited counts with its
        last reading, so a role's sum never drops when one of its processes is replaced."""
        for pid, cpu in tree_cpu(self.root).items():
            self.last[pid] = cpu
            # read again each time: a child caught between fork and exec still shows its parent's command line
            role = self.role_of(pid)
            self.roles[pid] = role or self.roles.get(pid, "unknown")
        per_role: dict[str, float] = {}
        for pid, cpu in self.last.items():
            per_role[self.roles[pid]] = per_role.get(self.roles[pid], 0.0) + cpu
        return per_role

    def stop(self) -> None:
        self.done.set()
        self.join()


def cpu_per_step(samples: list[tuple[int, dict[str, float]]], skip: int) -> dict[str, float]:
    """CPU seconds per step by role over the steady window, from (steps done, {role: cpu s}) samples.

    From the first sample past step `skip` to the first one that reached the last step count, among
    those in which every role of that first sample is present: CPU spent after the last step (shutdown)
    is not a step's, and a role that vanished from the samples cannot be compared."""
    start = next((i for i, (n, _) in enumerate(samples) if n >= skip + 1), None)
    if start is None:
        return {}
    n0, c0 = samples[start]
    whole = [i for i in range(start, len(samples)) if set(c0) <= set(samples[i][1])]
    end = next(i for i in whole if samples[i][0] >= samples[whole[-1]][0])
    n1, c1 = samples[end]
    if n1 <= n0:
        return {}
    return {role: (c1[role] - c0[role]) / (n1 - n0) for role in sorted(c0)}


def cpu_busy_s() -> Optional[float]:
    """Machine-wide non-idle CPU seconds since boot (Linux /proc/stat; hypervisor steal counts as
    busy: it is CPU this machine did not get), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped descendants (the fleet, once it exited)."""
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in ru)


def wait_quiet(max_wait_s: float, max_cores: float = 0.25, sample_s: float = 3.0) -> float:
    """Wait (up to max_wait_s) until other processes use < max_cores; returns the last sample."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0 = cpu_busy_s()
        if b0 is None:
            return float("nan")
        time.sleep(sample_s)
        busy = (cpu_busy_s() - b0) / sample_s
        if busy < max_cores or time.monotonic() >= deadline:
            return busy
        print(f"[benchmarks] machine busy ({busy:.2f} cores in use by others); waiting", flush=True)
