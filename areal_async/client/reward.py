"""A bring-your-own reward worker (see ``areal_async.client``); no torch."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import socket
from pathlib import Path
from typing import Awaitable, Callable, Union

import zmq
import zmq.asyncio

from protocols.messages import Batch, RewardRequest, RewardResult, Shutdown, unbatch
from protocols.sockets import make_socket, recv_message, run_async

from areal_async.base.control import ControlClient
from areal_async.base.records import REWARD_DIR, RewardRecord, worker_record_path
from areal_async.client import connect, join, load_run

__all__ = ["RewardWorker", "ScoreFn"]

log = logging.getLogger("areal_async.client")

ScoreFn = Callable[[str, list], Union[float, Awaitable[float]]]


class RewardWorker:
    """An external reward worker on reward slot ``slot`` of the fleet in ``run_dir``."""

    def __init__(
        self, run_dir: str | Path, score: ScoreFn, slot: int = 0, worker_id: str | None = None, concurrency: int = 4
    ):
        self.run_dir = Path(run_dir)
        self.cfg, self.ep = load_run(run_dir)
        n_builtin, n_ext = self.cfg.cluster.n_reward_workers, self.cfg.cluster.n_external_reward_workers
        if not 0 <= slot < n_ext:
            raise ValueError(
                f"slot={slot}: the fleet in {run_dir} keeps {n_ext} bring-your-own reward slot(s) "
                f"(cluster.n_external_reward_workers); expected 0..{n_ext - 1}"
            )
        if not callable(score):
            raise TypeError(f"score must be callable as score(completion, solutions) -> float, got {score!r}")
        self.score, self.slot, self.concurrency = score, slot, concurrency
        self.endpoint = self.ep.rewards[n_builtin + slot]
        self.worker_id = worker_id or f"external-reward-{slot}-{socket.gethostname()}"
        self.token = join(run_dir, "reward", self.worker_id)
        self.counts = {"ok": 0, "error": 0}
        worker_record_path(run_dir, REWARD_DIR, self.worker_id)  # an id that cannot name its record fails here
        self.record: RewardRecord | None = None  # what it scored, opened when it serves (base/records.py)

    def run(self) -> int:
        """Serve until the run ends (0)."""
        return run_async(self.arun())

    async def arun(self) -> int:
        ctx = zmq.asyncio.Context()
        try:  # bound before registering: a slot nobody can serve is never announced
            pull = make_socket(ctx, zmq.PULL, bind=self.endpoint)
        except zmq.ZMQError as e:
            ctx.term()
            raise RuntimeError(
                f"cannot serve reward slot {self.slot} at {self.endpoint} ({e}): has the fleet in {self.run_dir} ended?"
            ) from e
        control = connect(ctx, self.cfg, self.ep, "reward", self.worker_id, token=self.token)
        self.record = RewardRecord(self.run_dir, self.worker_id)
        try:
            await control.register(info={"external": True, "slot": self.slot})
            log.info("%s registered; serving %s", self.worker_id, self.endpoint)
            await _until_shutdown(control, self._serve(control, pull))
        finally:
            control.close()
            pull.close(0)
            ctx.term()
            self.record.close()
        return 0

    async def _serve(self, control: ControlClient, pull) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        while True:
            _, msg = await recv_message(pull, expect=(RewardRequest, Batch), where=self.worker_id)
            for req in [] if msg is None else unbatch(msg):
                await slots.acquire()
                asyncio.create_task(self._answer(control, req, slots))

    async def _answer(self, control: ControlClient, req: RewardRequest, slots: asyncio.Semaphore) -> None:
        try:
            outs = [await self._one(c, list(req.solutions)) for c in req.completions]
        finally:
            slots.release()
        for _, status, _ in outs:
            self.counts[status] += 1
        control.stats.update(self.counts)
        self.record.groups([(req.group_id, req.sample_ids, [o[0] for o in outs], [o[1] for o in outs])])
        await control.send(
            RewardResult(
                group_id=req.group_id,
                worker_id=self.worker_id,
                sample_ids=list(req.sample_ids),
                scores=[o[0] for o in outs],
                statuses=[o[1] for o in outs],
                details=[o[2] for o in outs],
            )
        )

    async def _one(self, completion: str, solutions: list[str]) -> tuple[float, str, str]:
        try:
            value = self.score(completion, solutions)
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:  # the plug-in's bug scores 0; the worker keeps serving
            log.warning("%s: score raised %s: %s", self.worker_id, type(e).__name__, e)
            return 0.0, "error", f"{type(e).__name__}: {e}"[:500]
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or not 0.0 <= float(value) <= 1.0
        ):
            return 0.0, "error", f"score returned {value!r:.100}; expected a float in [0, 1]"
        return float(value), "ok", ""


async def _until_shutdown(control: ControlClient, work: Awaitable) -> None:
    """Run ``work`` until the scheduler says Shutdown."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            recv = asyncio.ensure_future(control.recv())
            done, _ = await asyncio.wait({recv, task}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                recv.cancel()
                task.result()  # re-raise what ended the work
                return
            msg = recv.result()
            if isinstance(msg, Shutdown):
                log.info("shutdown: %s", msg.reason)
                return
    finally:
        task.cancel()
