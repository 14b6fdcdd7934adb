"""The real SchedulerService's share of its core at a steady heartbeat rate (``benchmarks.data_path
--heartbeat-rates``): the part of a large fleet's control traffic that grows with its workers.

At 1000 GPUs a fleet sends its scheduler ~500 heartbeats a second, at 10,000 ~5,000, against ~51 group
messages and 67 / 667 weight messages (``control_scale.control_messages``): heartbeats are most of the
traffic, and a heartbeat costs the service far less than the measured mix's average message (~11 groups
each). Here the service of ``scheduler_load`` (the same config, ipc control socket, roster, one CPU) has
its config's workers registered by a paced fleet in a child process, which then sends only heartbeats,
round-robin from its workers, evenly spaced at ``rate`` a second: each one wakes the service's loop and is
decoded, checked and booked (before 2026-12-06 17:00 also followed by a ``_drive``, which with no trainer
ready plans and admits nothing; since then a wakeup of heartbeats alone drives nothing), as a lone heartbeat
at scale is; the watchdog writes ``status.json`` every ``cluster.heartbeat_s``.
Measured over ``seconds`` after a settle: the service process's CPU seconds (its thread and ZeroMQ's I/O
thread) over wall seconds, the heartbeats it took, CPU microseconds per heartbeat. Not in it: the size of
a 10,000-worker table (``status.json`` lists every worker; this fleet has the config's 4).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from pathlib import Path

from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import Roster
from areal_async.config import load_config
from areal_async.data.prompts import prompt_encoder
from areal_async.models.tokenizer import load_tokenizer
from areal_async.scheduler.service import SchedulerService
from benchmarks.common.paced_fleet import paced_heartbeats
from benchmarks.common.scheduler_load import reap, service_dir
from protocols.sockets import run_async

SETTLE_S = 1.0  # after every worker registered and the paced heartbeats began


def measure_heartbeats(config: str, rate: float, seconds: float) -> dict:
    """One rate (see the module docstring); returns the row's fields."""
    cfg = load_config(config, ["total_train_steps=1000000000"])
    cpus = sorted(os.sched_getaffinity(0))
    with service_dir(cfg, "sched-hb-") as (ep, run_dir, roles, tokens):
        spawn = mp.get_context("spawn")
        q = spawn.Queue()
        fleet_s = SETTLE_S + seconds + 1.0  # the fleet outlasts the window
        child = spawn.Process(target=paced_heartbeats, args=(ep.control, roles, tokens, rate, fleet_s, cpus[1:], q))
        if cpus:
            os.sched_setaffinity(0, cpus[:1])
        try:
            child.start()
            out = run_async(_serve(cfg, ep, run_dir, len(roles), seconds))
        finally:
            os.sched_setaffinity(0, cpus)
            reap(child, grace_s=fleet_s + 30)
        sent = q.get(timeout=5) if not q.empty() else None
    return out | {"rate_asked": rate, "fleet_sent": sent}


async def _serve(cfg, ep: RunManifest, run_dir: Path, n_workers: int, seconds: float) -> dict:
    encode = prompt_encoder(load_tokenizer(cfg.model.path), cfg.train_dataset.template)
    svc = SchedulerService(cfg, ep, run_dir, t0=time.time(), tokenize=encode, roster=Roster.of_run(run_dir))
    task = asyncio.create_task(svc.run())
    try:
        deadline = time.monotonic() + 60
        while len(list(svc.workers)) < n_workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(list(svc.workers))} of {n_workers} workers registered in 60 s")
            await asyncio.sleep(0.01)
        await asyncio.sleep(SETTLE_S)
        a = (time.perf_counter(), time.process_time(), svc.received.get("heartbeat", 0))
        await asyncio.sleep(seconds)
        b = (time.perf_counter(), time.process_time(), svc.received.get("heartbeat", 0))
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 10)
    wall, cpu, n = b[0] - a[0], b[1] - a[1], b[2] - a[2]
    return {
        "value": cpu / wall,
        "seconds": wall,
        "cpu_seconds": cpu,
        "heartbeats": n,
        "heartbeats_per_s": n / wall,
        "cpu_us_per_heartbeat": cpu / n * 1e6 if n else None,
    }
