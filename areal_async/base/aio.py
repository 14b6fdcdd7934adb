"""Fail loudly, never hang: the asyncio tasks of a role's loop, watched as one.

A task that raises inside ``asyncio.create_task`` is only reported when it is garbage-collected;
until then the process lives on with a dead loop (the scheduler's serve loop once died this way
while the process kept running). ``TaskSet`` keeps every task a service starts: the first one
that raises (or a long-lived one that returns) makes ``wait`` raise ``RoleLoopError`` naming it,
with the original exception as its cause, after cancelling the others. The worker entry point
then logs the traceback and exits non-zero, and the supervisor acts on the exit.
"""

from __future__ import annotations

import asyncio
from typing import Coroutine, Optional


class RoleLoopError(RuntimeError):
    """A task of a role's loop failed or ended unexpectedly."""


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._failed: Optional[tuple[str, Optional[BaseException]]] = None
        self._wake = asyncio.Event()

    def spawn(self, coro: Coroutine, name: str, forever: bool = False) -> asyncio.Task:
        """Start ``coro``; ``forever``: it is a loop whose return is itself a failure."""
        return self.adopt(asyncio.create_task(coro, name=name), forever)

    def adopt(self, task: asyncio.Task, forever: bool = False) -> asyncio.Task:
        """Watch a task started elsewhere (e.g. a heartbeat)."""
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, forever))
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task, forever: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._failed is not None:
            return
        exc = task.exception()
        if exc is not None or forever:
            self._failed = (task.get_name(), exc)
            self._wake.set()

    async def wait(self, stop: asyncio.Event) -> None:
        """Return when ``stop`` is set; raise RoleLoopError as soon as a task failed."""
        stopper = asyncio.ensure_future(stop.wait())
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({stopper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            waker.cancel()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._failed is None:
            return
        name, exc = self._failed
        self.cancel()
        if exc is None:
            raise RoleLoopError(f"task {name!r} ended, but it should run until the worker stops")
        raise RoleLoopError(f"task {name!r} failed: {type(exc).__name__}: {exc}") from exc

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()
