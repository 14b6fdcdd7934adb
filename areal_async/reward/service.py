"""The reward worker process: RewardRequests from a PULL queue, scores from a killable pool.

Rollout workers PUSH ``RewardRequest`` frames to every reward worker's PULL socket (ZeroMQ
spreads them round-robin). A request carries one group's completions; they are scored by
``RewardPool`` (math-verify in killable processes, up to ``n_procs`` checks at once) and one
``RewardResult`` with the group's scores goes to the scheduler. At most ``n_procs`` batches are
taken off the queue at a time, so an idle reward worker is not starved by a busy one; a batch is
one request plus those already queued on this worker's socket (up to ``MAX_BATCH_GROUPS``),
scored in one pool call: a round trip per child per batch, not per group. A
malformed frame is logged and dropped; the worker keeps serving. Anything else that raises (a
``score_many`` that fails instead of scoring 0) ends the process non-zero with its traceback
(``TaskSet``): the supervisor restarts it and the scheduler re-issues what it held; the group
deadline (``reward.deadline_s``) covers a request lost with it. ``Shutdown(lost=True)`` from the
scheduler ends it non-zero too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from protocols.messages import RewardRequest, RewardResult, Shutdown
from protocols.sockets import make_socket, recv_message

from areal_async.reward.pool import RewardPool
from areal_async.base.control import ControlClient
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.reward")

MAX_BATCH_GROUPS = 32  # requests scored in one pool call (one taken plus those already queued)


class RewardService:
    def __init__(
        self,
        worker_id: str,
        control: ControlClient,
        ctx: zmq.asyncio.Context,
        bind: str,
        pool: RewardPool,
        n_procs: int,
    ):
        self.worker_id, self.control, self.pool = worker_id, control, pool
        self.pull = make_socket(ctx, zmq.PULL, bind=bind)
        self.n_procs = n_procs
        self.slots = asyncio.Semaphore(n_procs)
        self.stop = asyncio.Event()
        self.counts = {"ok": 0, "timeout": 0, "error": 0}
        self._scoring, self._busy_since, self.busy_s = 0, 0.0, 0.0  # wall time with >= 1 group in the pool
        self.tasks: TaskSet | None = None
        self.exit_code = 0
        self.scoring = 0  # groups being scored now

    async def run(self) -> int:
        await self.control.register(info={"n_procs": self.n_procs})
        self.tasks = TaskSet()
        self.tasks.adopt(self.control.heartbeat_task, forever=True)
        self.tasks.spawn(self._work(), "reward.work", forever=True)
        self.tasks.spawn(self._control(), "reward.control", forever=True)
        self._note_waiting()
        try:
            await self.tasks.wait(self.stop)  # raises if a loop or a scoring task failed
        finally:
            self.tasks.cancel()
            self.pool.close()  # kill and reap the checking processes before the worker exits
            self.pull.close(0)
        return self.exit_code

    def _note_waiting(self) -> None:
        """What this worker waits for (heartbeat stats, read by the step watchdog)."""
        self.control.stats["waiting_for"] = f"scoring {self.scoring} group(s)" if self.scoring else "reward requests"

    async def _control(self) -> None:
        while True:
            msg = await self.control.recv()
            if isinstance(msg, Shutdown) and msg.lost:
                log.error("%s: the scheduler declared this worker lost (%s); exiting", self.worker_id, msg.reason)
                self.exit_code = 1
                self.stop.set()
            elif isinstance(msg, Shutdown):
                self.stop.set()

    async def _work(self) -> None:
        while True:
            _, req = await recv_message(self.pull, expect=(RewardRequest,), where=self.worker_id)
            if req is None:
                continue
            await self.slots.acquire()
            batch = [req] + await self._queued(MAX_BATCH_GROUPS - 1)
            self.tasks.spawn(self._score(batch), f"reward.score.{req.group_id}+{len(batch) - 1}")

    async def _queued(self, limit: int) -> list[RewardRequest]:
        """Up to ``limit`` requests already waiting on the socket (never waits for one)."""
        out: list[RewardRequest] = []
        while len(out) < limit and self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            _, req = await recv_message(self.pull, expect=(RewardRequest,), where=self.worker_id)
            if req is not None:
                out.append(req)
        return out

    async def _score(self, batch: list[RewardRequest]) -> None:
        """Score the batch's groups in one pool call; one RewardResult per group."""
        self._busy(+1)
        self.scoring += len(batch)
        self._note_waiting()
        try:
            outs = await self.pool.score_many([(c, req.solutions) for req in batch for c in req.completions])
        finally:
            self.slots.release()
            self._busy(-1)
            self.scoring -= len(batch)
            self._note_waiting()
        start = 0
        for req in batch:
            await self._result(req, outs[start : start + len(req.completions)])
            start += len(req.completions)

    async def _result(self, req: RewardRequest, outs: list) -> None:
        for sid, out in zip(req.sample_ids, outs):
            self.counts[out.status] = self.counts.get(out.status, 0) + 1
            if out.status != "ok":
                log.warning("sample %s scored 0: %s %s", sid, out.status, out.detail)
        self.control.stats.update(self.counts, busy_s=round(self.busy_s, 4))
        await self.control.send(
            RewardResult(
                group_id=req.group_id,
                worker_id=self.worker_id,
                sample_ids=list(req.sample_ids),
                scores=[float(o.score) for o in outs],
                statuses=[o.status for o in outs],
                details=[o.detail[:500] for o in outs],
            )
        )

    def _busy(self, delta: int) -> None:
        """Count the wall time during which at least one group is being scored."""
        now = time.perf_counter()
        if self._scoring == 0:
            self._busy_since = now
        self._scoring += delta
        if self._scoring == 0:
            self.busy_s += now - self._busy_since
