"""Threads that follow the work (``cluster.share_cores``): the torch workers of a run on one machine share
its CPUs by who is busy now, not by a fixed count each.

Why: on a few-core machine the roles take turns. An async fleet's trainer is the bottleneck while the
rollout worker waits for weights most of the time (SmolLM2 on 2 cores: ~25 s steps on one thread, the
rollout idle ~78 %); one thread each leaves a core idle, two each make four threads fight over two cores
(every OpenMP barrier then waits for a descheduled thread). Here each worker takes, before each unit of
work, an equal share of its CPUs among the workers busy at that moment:

    RUN_DIR/cores   one byte per torch worker (trainer ranks, then rollout workers), mmapped by all:
                    1 while it computes (a training step, an evaluation; an engine step or weight load),
                    0 while it waits
    pace()          before a unit of work (a decoder layer's forward, and its backward; an engine step):
                    threads = this worker's share of len(sched_getaffinity) among the busy workers
                    (itself included), and no more than the CPUs nothing else is running on now
                    (/proc/loadavg's runnable count: other programs, a reward check), at least 1;
                    torch.set_num_threads only when it changes

So the trainer runs on both cores while generation idles and gives one back within a layer (~0.1-0.3 s
at SmolLM2's size) of a rollout starting an engine step. The runnable count matters on a shared machine:
an OpenMP team with more threads than free cores waits at every barrier for a thread the kernel has not
scheduled (with ``sched_autogroup`` each session gets an equal share, so another session's ``nice 19``
tests take a whole core from a 2-thread team); the table alone only knows the run's own workers. Threads
runnable beyond the worker's own team count as foreign (its OpenMP threads are runnable for a moment after
each parallel region), so a team notices another program once a sample catches it beside its own threads,
and a single thread notices it at once. ``torch.set_num_threads`` sets the OpenMP thread count of the
calling thread, so ``pace`` runs in the thread that computes (the trainer's executor thread, the rollout's
engine thread), and autograd's CPU backward runs in that same thread. OpenMP's idle threads
must not spin: libgomp by default spins ~300,000 iterations after each parallel region before it sleeps,
holding a core another worker could use, so the supervisor starts the workers with
``OMP_WAIT_POLICY=PASSIVE`` when sharing is on (unless the environment sets it).

Covered: one machine (``cluster.n_nodes`` 1; the table is a file of the run directory), the local,
Slurm and Ray launchers alike. A worker that dies while busy leaves its byte at 1 until its restart
takes the same slot: the others then use fewer threads, never more. Not covered: reward checks and
the scheduler (short bursts, not torch) are not counted; CPUs pinned apart per role
(``cluster.cpu_affinity``) make the shares moot (each worker's own CPU count bounds its threads).
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import time
from pathlib import Path
from typing import Callable, Optional

CORES_FILE = "cores"
WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # idle OpenMP threads sleep instead of spinning


def runnable_now() -> int:
    """Threads runnable on this machine at this instant, the caller's included (/proc/loadavg's fourth field,
    "runnable/total"); 1 where it cannot be read (the caller alone)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 1


def slot_of(role: str, index: int, n_trainer_ranks: int) -> int:
    """A worker's byte in the table: trainer rank r -> r, rollout worker i -> n_trainer_ranks + i."""
    if role == "trainer":
        return index
    if role == "rollout":
        return n_trainer_ranks + index
    raise ValueError(f"role {role!r} shares no cores; expected 'trainer' or 'rollout'")


def fair_share(cpus: int, busy: list[int], me: int) -> int:
    """Threads of worker ``me`` when the workers ``busy`` (``me`` counted whether listed or not) split
    ``cpus`` CPUs evenly, the remainder to the lowest slots; at least 1."""
    workers = sorted(set(busy) | {me})
    base, extra = divmod(cpus, len(workers))
    return max(1, base + (1 if workers.index(me) < extra else 0))


class CoreShare:
    """This process's place in a run's CPU table (``RUN_DIR/cores``, ``n_slots`` bytes)."""

    def __init__(
        self,
        path: str | Path,
        n_slots: int,
        slot: int,
        cpus: Optional[int] = None,
        running: Optional[Callable[[], int]] = None,
    ):
        """``running()``: threads runnable on the machine now, the caller included (default: /proc/loadavg)."""
        if not 0 <= slot < n_slots:
            raise ValueError(f"core slot {slot}: expected 0 <= slot < {n_slots}")
        self.slot, self.n_slots = slot, n_slots
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.running = running or runnable_now
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < n_slots:
                os.ftruncate(fd, n_slots)  # zero-filled: nobody busy; every worker truncates to the same size
            self._map = mmap.mmap(fd, n_slots)
        finally:
            os.close(fd)
        self.threads = 0  # the count set last (0: none yet)
        self.busy_s = 0.0
        self.set_busy(False)

    @classmethod
    def for_worker(cls, run_dir: str | Path, cluster, role: str, index: int) -> "CoreShare":
        n = cluster.n_trainer_ranks + cluster.n_rollout_workers
        return cls(Path(run_dir) / CORES_FILE, n, slot_of(role, index, cluster.n_trainer_ranks))

    def set_busy(self, busy: bool) -> None:
        self._map[self.slot] = 1 if busy else 0

    def busy_slots(self) -> list[int]:
        table = self._map[: self.n_slots]
        return [i for i, b in enumerate(table) if b]

    def share(self) -> int:
        """This worker's threads now (as if it were busy): its share among the busy workers, within the CPUs
        nothing else runs on."""
        # the runnable count includes the caller and may include its own OpenMP threads (a thread that just left
        # a parallel region is runnable until it sleeps): whatever runs beyond this worker's team is foreign
        free = self.cpus - max(0, self.running() - max(1, self.threads))
        return max(1, min(fair_share(self.cpus, self.busy_slots(), self.slot), free))

    def pace(self) -> int:
        """Set this thread's torch threads to the share, when it changed; returns it."""
        n = self.share()
        if n != self.threads:
            import torch

            torch.set_num_threads(n)
            self.threads = n
        return n

    @contextlib.contextmanager
    def busy(self):
        """Marked busy (and paced) for the block; the threads stay set for the next unit of work."""
        t = time.perf_counter()
        self.set_busy(True)
        try:
            self.pace()
            yield self
        finally:
            self.set_busy(False)
            self.busy_s += time.perf_counter() - t

    def close(self) -> None:
        self.set_busy(False)
        self._map.close()


# ---- the process's share, for the code that computes (trainer/compute/lean_forward.py, rollout/service.py) --------

_SHARE: Optional[CoreShare] = None


def install(share: Optional[CoreShare]) -> None:
    """Make ``share`` this process's (None: no sharing; ``pace`` does nothing)."""
    global _SHARE
    _SHARE = share


def install_for(run_dir: str | Path, cluster, role: str, index: int) -> Optional[CoreShare]:
    """A torch worker's share when ``cluster.share_cores`` is on (installed for this process), else None."""
    share = CoreShare.for_worker(run_dir, cluster, role, index) if getattr(cluster, "share_cores", False) else None
    install(share)
    if share is not None:  # a worker that exits while marked busy (at a shutdown) leaves its slot idle
        atexit.register(share.set_busy, False)
    return share


def current() -> Optional[CoreShare]:
    return _SHARE


def working():
    """A context in which this process counts as busy (no-op without sharing)."""
    share = _SHARE
    return share.busy() if share is not None else contextlib.nullcontext()


def mark(busy: bool) -> None:
    """This process busy or idle from now on (no-op without sharing); busy also paces."""
    share = _SHARE
    if share is not None:
        share.set_busy(busy)
        if busy:
            share.pace()


def pace(x=None):
    """Between two units of work: this thread's threads to the share, when sharing is on. Given a tensor that
    needs grad (a decoder layer's input), the same again when its gradient is computed: before the backward
    of the layer beneath it. Returns ``x``."""
    share = _SHARE
    if share is None:
        return x
    share.pace()
    if x is not None and getattr(x, "requires_grad", False):
        x.register_hook(_pace_grad)
    return x


def _pace_grad(grad):
    share = _SHARE
    if share is not None:
        share.pace()
    return None  # the gradient unchanged
