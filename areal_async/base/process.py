"""Process-wide settings of a worker: its log format, its torch thread count and how much freed heap it keeps."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading

# A worker whose build (config, plug-ins, data, model) failed on an error no restart can fix exits
# with BUILD_FAILED_EXIT_CODE (78, sysexits' EX_CONFIG) after logging BUILD_FAILED_MARK + the error
# as its last line; the supervisor then fails the run at once instead of restarting or recovering.
BUILD_FAILED_EXIT_CODE = 78
BUILD_FAILED_MARK = "BUILD FAILED (no restart can fix this): "
# the same exit for an error met at run time that no restart fixes (``Unfixable``: every inference server
# refuses the trainer's weights), its last log line UNFIXABLE_MARK + the reason
UNFIXABLE_MARK = "FAILED (no restart can fix this): "


class Unfixable(RuntimeError):
    """Raised by a worker's loop for a failure a restarted worker would meet again; the worker exits
    BUILD_FAILED_EXIT_CODE and the supervisor fails the run at once, naming the message."""


BUILD_ERRORS = (
    ImportError,
    SyntaxError,
    ValueError,
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
)


def setup_worker_logging(worker_id: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("AREAL_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format=f"%(asctime)s {worker_id} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(f"areal_async.{worker_id}")


def set_torch_threads(n: int) -> None:
    """OMP_NUM_THREADS (unless set) and torch's intra-op pool; imports torch, so call it where torch is wanted."""
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch  # heavy: only the processes that call this (trainer, rollout, sft) pay for it

    torch.set_num_threads(n)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit


def retain_freed_heap(mb: int) -> bool:
    """Keep up to ``mb`` MiB of freed memory in this process's heap instead of handing it back to the
    OS (glibc ``mallopt``: blocks up to min(mb, 32) MiB come from the heap, whose top is trimmed only
    past ``mb`` MiB). A training or decoding step allocates and frees the same activation-sized
    blocks every time; with glibc's defaults each comes back as fresh pages, one fault per 4 KiB
    touched (the tiny trainer: ~900 faults, ~2 ms of system time per 32 ms step). ``mb`` = 0 keeps
    glibc's defaults. Returns whether the settings took (False off glibc, e.g. musl or macOS)."""
    if mb <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    limit = mb << 20
    settings = (
        (_M_MMAP_THRESHOLD, min(limit, _MMAP_THRESHOLD_MAX)),
        (_M_TRIM_THRESHOLD, limit),
        (_M_TOP_PAD, min(limit, 64 << 20)),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)


def limit_malloc_arenas(n: int) -> bool:
    """At most ``n`` glibc malloc arenas in this process (``mallopt(M_ARENA_MAX)``); call it before threads
    allocate. glibc gives each thread that allocates while another holds the arena an arena of its own, up
    to 8 per core, and memory freed in one arena serves only the threads of that arena. A trainer runs its
    steps, evaluations and publications on whichever executor thread is idle, so each thread that ever ran
    a step kept a step's freed activations for itself: measured here, a thread that allocated and freed
    400 MiB of 10 MiB tensors left RSS +400 MiB per new thread (1,200 MiB after three), +224 MiB in all
    with one arena. ``n`` = 0 keeps glibc's default. Returns whether it took (False off glibc)."""
    if n <= 0:
        return False
    try:
        return ctypes.CDLL(None).mallopt(_M_ARENA_MAX, n) == 1
    except (OSError, AttributeError):
        return False


def setup_torch_process(cluster) -> None:
    """What every torch worker (trainer, rollout, SFT, evaluator) sets first, from ``cfg.cluster``: its
    torch threads (``torch_threads``), its malloc arenas (``malloc_arenas``) and the freed heap it keeps
    (``retained_heap_mb``)."""
    set_torch_threads(cluster.torch_threads)
    log = logging.getLogger("areal_async.process")
    if cluster.malloc_arenas > 0 and not limit_malloc_arenas(cluster.malloc_arenas):
        log.info("cluster.malloc_arenas=%d not applied: this C library has no glibc mallopt", cluster.malloc_arenas)
    if cluster.retained_heap_mb > 0 and not retain_freed_heap(cluster.retained_heap_mb):
        log.info(
            "cluster.retained_heap_mb=%d not applied: this C library has no glibc mallopt", cluster.retained_heap_mb
        )


def exit_without_teardown(code: int) -> None:
    """End this process as the interpreter ends one, less its teardown: non-daemon threads joined, ``atexit``
    handlers run, stdout and stderr flushed, then ``os._exit`` with ``code``'s low byte (the status the OS
    keeps of ``exit(code)``). Skipped: the last collection and the teardown of every module, whose cost grows
    with what was imported (torch and transformers: a few tenths of a second). An object still alive then is
    not finalized: a file left open with unwritten data loses it (pyzmq closes nothing at that point either;
    the project's records flush every line as written). For the end of a process that imported much."""
    threading._shutdown()  # what the interpreter calls first (private, in every CPython since 3.0)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)
