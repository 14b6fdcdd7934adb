"""Shared life of a worker process: logging, signals, build, run on uvloop, exit code."""

from __future__ import annotations

import asyncio
import signal

from protocols.sockets import run_async

from areal_async.runtime.fleet import setup_worker_logging


def run_worker(role: str, run_dir: str, worker_id: str, index: int) -> int:
    log = setup_worker_logging(worker_id)
    from areal_async.runtime import build

    builders = {"scheduler": lambda: build.build_scheduler(run_dir),
                "reward": lambda: build.build_reward(run_dir, worker_id, index),
                "trainer": lambda: build.build_trainer(run_dir, worker_id),
                "rollout": lambda: build.build_rollout(run_dir, worker_id, index)}

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)  # SIGTERM from the supervisor: unwind and exit
        service = builders[role]()
        log.info("%s started", worker_id)
        return await service.run()

    try:
        code = run_async(main())
    except asyncio.CancelledError:
        log.info("%s stopped by signal", worker_id)
        return 143
    log.info("%s exiting with code %s", worker_id, code)
    return int(code or 0)
