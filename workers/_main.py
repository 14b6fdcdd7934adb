"""The shared command line of the worker entry points (started by the supervisor).

    python -m workers.<role> --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]

``--cpus`` (Linux cpu-list syntax, e.g. ``0`` or ``2-5,8``; from ``cluster.cpu_affinity``)
pins the process before anything heavy is imported, so every thread it starts later (torch's
pools, ZeroMQ's I/O thread) and every process it spawns (reward-pool children) inherits the pin.
"""

from __future__ import annotations

import argparse


def worker_main(role: str, argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"workers.{role}")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--worker-id", default=role)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--cpus", default="", help="pin this process to these CPUs (cpu-list syntax)")
    args = p.parse_args(argv)
    if args.cpus:
        from areal_async.runtime.affinity import pin_self

        pin_self(args.cpus)
    from areal_async.runtime.entry import run_worker  # heavy imports after parsing and pinning

    return run_worker(role, args.run_dir, args.worker_id, args.index)
