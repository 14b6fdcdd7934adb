"""The shared command line of the worker entry points (started by the supervisor).

    python -m workers.<role> --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]

``--cpus`` (Linux cpu-list syntax, e.g. ``0`` or ``2-5,8``; from ``cluster.cpu_affinity``)
pins the process before anything heavy is imported, so every thread it starts later (torch's
pools, ZeroMQ's I/O thread) and every process it spawns (reward-pool children) inherits the pin.
Each ``workers/<role>.py`` therefore imports its builder (``areal_async.app.workers.<role>_worker``)
only after ``worker_args`` returns.

Every worker registers its stack dump (``base/stacks.py``: SIGUSR2 -> ``RUN_DIR/stacks/<id>.txt``)
here, first of all, so the supervisor's hang capture reaches it from its first import on, and asks to end
with the process that started it (``base/parent.py``: a supervisor killed outright leaves no fleet behind).
"""

from __future__ import annotations

import argparse

from areal_async.base.affinity import pin_self
from areal_async.base.parent import die_with_parent
from areal_async.base.stacks import register_stack_dump


def worker_args(role: str, argv=None) -> argparse.Namespace:
    """The parsed command line; the process is pinned to ``--cpus`` (if given) when this returns."""
    p = argparse.ArgumentParser(prog=f"workers.{role}")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--worker-id", default=role)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--cpus", default="", help="pin this process to these CPUs (cpu-list syntax)")
    args = p.parse_args(argv)
    register_stack_dump(args.run_dir, args.worker_id)
    die_with_parent()
    if args.cpus:
        pin_self(args.cpus)
    return args
