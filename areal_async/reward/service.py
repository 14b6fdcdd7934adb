"""The reward worker process: reward requests from a PULL queue, scores from a killable pool.

Rollout workers PUSH a ``Batch`` of ``RewardRequest`` each (the groups of one engine step, split over the
reward workers) to every reward worker's PULL socket (ZeroMQ spreads them round-robin); a lone
``RewardRequest`` (one group) is taken too. A group's completions are scored by
``RewardPool`` (math-verify in killable processes, up to ``n_procs`` checks at once). At most
``n_procs`` batches are taken off the queue at a time, so an idle reward worker is not starved by
a busy one; a batch is one message's groups plus those already queued on this worker's socket (up
to ``MAX_BATCH_GROUPS``, read without waiting), scored in one pool call (a round trip per child per
batch, not per group), and its groups' scores go to the scheduler in one ``Batch`` of ``RewardResult``
(booked group by group). A malformed frame is logged and dropped;
the worker keeps serving. Anything else that raises (a ``score_many`` that fails instead of
scoring 0) ends the process non-zero with its traceback (``TaskSet``): the supervisor restarts it
and the scheduler re-issues what it held; the group deadline (``reward.deadline_s``) covers a
request lost with it. ``Shutdown(lost=True)`` from the scheduler ends it non-zero too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from protocols.messages import Batch, RewardRequest, RewardResult, Shutdown, unbatch
from protocols.sockets import decode_logged, make_socket, recv_message

from areal_async.reward.pool import RewardPool
from areal_async.reward.samples import RewardSampleLog
from areal_async.base.control import ControlClient
from areal_async.base.records import RewardRecord
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.reward")

MAX_BATCH_GROUPS = 32  # requests scored in one pool call (one taken plus those already queued)


_REQUESTS = (RewardRequest, Batch)  # one group, or a Batch of them (one message per engine step)


class RewardService:
    def __init__(
        self,
        worker_id: str,
        control: ControlClient,
        ctx: zmq.asyncio.Context,
        bind: str,
        pool: RewardPool,
        n_procs: int,
        samples: RewardSampleLog | None = None,
        record: RewardRecord | None = None,
    ):
        """``record``: this worker's own record of what it scored (``base/records.py``), each group's
        line written before its result goes out."""
        self.worker_id, self.control, self.pool = worker_id, control, pool
        self.samples = samples  # a few scored completions for `areal-async doctor` (reward/samples.py)
        self.record = record
        self.pull = make_socket(ctx, zmq.PULL, bind=bind)
        self.queued = zmq.Socket.shadow(self.pull.underlying)  # the same socket, read without a Future per frame
        self.n_procs = n_procs
        self.slots = asyncio.Semaphore(n_procs)
        self.stop = asyncio.Event()
        self.counts = {"ok": 0, "timeout": 0, "error": 0}
        self._scoring, self._busy_since, self.busy_s = 0, 0.0, 0.0  # wall time with >= 1 group in the pool
        self.checks, self.check_s = 0, 0.0  # completions scored, and the sum of their checks' wall times
        self.tasks: TaskSet | None = None
        self.exit_code = 0
        self.scoring = 0  # groups being scored now
        self._started: dict[int, float] = {}  # id(batch) -> monotonic start of its scoring

    async def run(self) -> int:
        await self.control.register(info={"n_procs": self.n_procs})
        self.control.live_stats = self._live_stats
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
            self.control.close()  # every socket closed: the context's term() at exit cannot wait on one
            if self.samples is not None:
                self.samples.close()
            if self.record is not None:
                self.record.close()
        return self.exit_code

    def _live_stats(self) -> dict:
        """The age of the oldest batch being scored now, as of each heartbeat (0: none)."""
        oldest = min(self._started.values(), default=None)
        return {"scoring_oldest_s": 0.0 if oldest is None else round(time.monotonic() - oldest, 1)}

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
            _, msg = await recv_message(self.pull, expect=_REQUESTS, where=self.worker_id)
            if msg is None:
                continue
            await self.slots.acquire()
            batch = unbatch(msg)
            batch += self._queued(MAX_BATCH_GROUPS - len(batch))
            self.tasks.spawn(self._score(batch), f"reward.score.{batch[0].group_id}+{len(batch) - 1}")

    def _queued(self, limit: int) -> list[RewardRequest]:
        """The groups of the requests already waiting on the socket, until at least ``limit`` (never
        waits for one; a message's groups stay together). Read through the synchronous shadow of the
        socket, as the scheduler does: no Future per frame."""
        out: list[RewardRequest] = []
        while len(out) < limit:
            try:
                frames = self.queued.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            _, msg = decode_logged(frames, expect=_REQUESTS, where=self.worker_id)
            if msg is not None:
                out += unbatch(msg)
        return out

    async def _score(self, batch: list[RewardRequest]) -> None:
        """Score the batch's groups in one pool call; their scores go out in one Batch of RewardResult."""
        self._busy(+1)
        self._started[id(batch)] = time.monotonic()
        self.scoring += len(batch)
        self._note_waiting()
        try:
            outs = await self.pool.score_many(_items(batch))
        finally:
            self.slots.release()
            self._started.pop(id(batch), None)
            self._busy(-1)
            self.scoring -= len(batch)
            self._note_waiting()
        per_group, start = [], 0
        for req in batch:
            per_group.append(outs[start : start + len(req.completions)])
            start += len(req.completions)
        if self.record is not None:  # before the result leaves: what this worker scored, id by id
            self.record.groups(
                [
                    (r.group_id, r.sample_ids, [o.score for o in g], [o.status for o in g])
                    for r, g in zip(batch, per_group)
                ]
            )
        await self.control.send(self._results(batch, per_group))

    def _results(self, batch: list[RewardRequest], per_group: list[list]) -> Batch:
        """The batch's scores as one message (each group booked as its own RewardResult)."""
        for req, outs in zip(batch, per_group):
            if self.samples is not None:
                self.samples.group(req.group_id, req.completions, req.solutions, outs)
            for sid, out in zip(req.sample_ids, outs):
                self.counts[out.status] = self.counts.get(out.status, 0) + 1
                if out.status != "ok":
                    log.warning("sample %s scored 0: %s %s", sid, out.status, out.detail)
        self.checks += sum(len(outs) for outs in per_group)
        self.check_s += sum(o.elapsed_s for outs in per_group for o in outs)  # a judge's batch: its first reply
        self.control.stats.update(
            self.counts, busy_s=round(self.busy_s, 4), checks=self.checks, check_s=round(self.check_s, 4)
        )
        return Batch.of(
            [
                RewardResult(
                    group_id=req.group_id,
                    worker_id=self.worker_id,
                    sample_ids=list(req.sample_ids),
                    scores=[float(o.score) for o in outs],
                    statuses=[o.status for o in outs],
                    details=[o.detail[:500] for o in outs],
                )
                for req, outs in zip(batch, per_group)
            ]
        )

    def _busy(self, delta: int) -> None:
        """Count the wall time during which at least one group is being scored."""
        now = time.perf_counter()
        if self._scoring == 0:
            self._busy_since = now
        self._scoring += delta
        if self._scoring == 0:
            self.busy_s += now - self._busy_since


def _items(batch: list[RewardRequest]) -> list[tuple]:
    """The pool's checks: (completion, solutions), or with the group's question when the requests carry one
    (a judge's run: the rollout worker sends it); a batch mixing both gives every check its question or ""."""
    if any(req.prompt for req in batch):
        return [(c, req.solutions, req.prompt) for req in batch for c in req.completions]
    return [(c, req.solutions) for req in batch for c in req.completions]
