"""Shared life of a worker process: logging, signals, build, run on uvloop, exit code.

Fail loudly, never hang: an unexpected exception anywhere in a role's loop (see ``TaskSet``)
reaches here; its traceback goes to the worker's log and the process exits with
``FAILED_EXIT_CODE`` at once (``os._exit``: an executor thread blocked on a dead peer must not
keep a failed process alive), so the supervisor restarts the worker or fails the run.

A build that fails on an error no restart can fix (``BUILD_ERRORS``: an import, a config value, a
missing file, a plug-in of the wrong shape) exits ``BUILD_FAILED_EXIT_CODE`` instead, its last log
line ``BUILD_FAILED_MARK`` + the error: the supervisor stops the run at once and says why. So does a
loop that raises ``Unfixable`` (an error met at run time that a restarted worker would meet again), its
last line ``UNFIXABLE_MARK`` + the reason.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from typing import Callable

from areal_async.base.process import (
    BUILD_ERRORS,
    BUILD_FAILED_EXIT_CODE,
    BUILD_FAILED_MARK,
    UNFIXABLE_MARK,
    Unfixable,
    setup_worker_logging,
)
from protocols.sockets import run_async

FAILED_EXIT_CODE = 70  # EX_SOFTWARE: the worker's own loop failed (traceback in its log)


def run_worker(worker_id: str, build: Callable[[], object]) -> int:
    """Build the service (``build()``, an object with a ``run()`` coroutine) and run it until it returns
    or SIGTERM/SIGINT arrives (exit code 143)."""
    log = setup_worker_logging(worker_id)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)  # SIGTERM from the supervisor: unwind and exit
        try:
            service = build()
        except BUILD_ERRORS as e:
            raise _BuildFailed(e) from e
        # what the build made (modules, model, engine, sockets) lives as long as the process: moved out of
        # the collector's generations, so no collection walks it again (fleet trainer: ~1 ms less per step)
        gc.freeze()
        log.info("%s started", worker_id)
        return await service.run()

    try:
        code = run_async(main())
    except asyncio.CancelledError:
        log.info("%s stopped by signal", worker_id)
        return 143
    except _BuildFailed as e:
        log.exception("%s failed to build; exiting with code %d", worker_id, BUILD_FAILED_EXIT_CODE)
        log.error("%s%s: %s", BUILD_FAILED_MARK, type(e.error).__name__, e.error)
        _exit_now(BUILD_FAILED_EXIT_CODE)
    except Unfixable as e:
        log.exception("%s failed; exiting with code %d", worker_id, BUILD_FAILED_EXIT_CODE)
        log.error("%s%s", UNFIXABLE_MARK, e)
        _exit_now(BUILD_FAILED_EXIT_CODE)
    except BaseException:
        log.exception("%s failed; exiting with code %d", worker_id, FAILED_EXIT_CODE)
        _exit_now(FAILED_EXIT_CODE)
    log.info("%s exiting with code %s", worker_id, code)
    return int(code or 0)


class _BuildFailed(Exception):
    """The build raised one of BUILD_ERRORS (kept as ``error``)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
