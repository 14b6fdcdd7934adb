"""Shared life of a worker process: logging, signals, build, run on uvloop, exit code."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from areal_async.base.process import setup_worker_logging
from protocols.sockets import run_async


def run_worker(worker_id: str, build: Callable[[], object]) -> int:
    """Build the service (``build()``, an object with a ``run()`` coroutine) and run it until it returns
    or SIGTERM/SIGINT arrives (exit code 143)."""
    log = setup_worker_logging(worker_id)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)  # SIGTERM from the supervisor: unwind and exit
        service = build()
        log.info("%s started", worker_id)
        return await service.run()

    try:
        code = run_async(main())
    except asyncio.CancelledError:
        log.info("%s stopped by signal", worker_id)
        return 143
    log.info("%s exiting with code %s", worker_id, code)
    return int(code or 0)
