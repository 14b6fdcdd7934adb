"""The scheduler process: SchedulerCore behind one ROUTER socket.

It registers workers, forwards published weights to every rollout worker, turns events into
the core's actions, writes the run's books (``RunLog``) and ends the run: after
``total_train_steps`` it aborts what is still open, writes ``summary.json`` and sends
``Shutdown`` to everyone. A worker that stops heart-beating for ``cluster.worker_timeout_s``, or
registers again (restarted by the supervisor), is declared lost: a lost rollout worker's open
groups, and after a lost reward worker every open group waiting for a score, are aborted and
their prompts re-issued.

Registration is checked against the supervisor's roster (``base/runkeys.Roster``): the worker id
must be one the supervisor launched, with that role and its launch token; anything else is
refused with an ``Error`` and changes nothing (a live worker of that id keeps its work). After
registration every message must come from the routing identity that registered.

Liveness (never hang silently):

- any exception other than a refused message (ValueError / KeyError) ends the process with a
  traceback and a non-zero exit (``TaskSet``), so the supervisor acts;
- a worker lost by heartbeat timeout is told (``Shutdown(lost=True)``) and recorded in
  ``RUN_DIR/lost.jsonl``; the supervisor kills it if it does not exit. A lost trainer stops
  planning: the supervisor fails (or recovers) the run;
- every running group has a deadline (``rollout.gen_deadline_s``, ``reward.deadline_s``): past
  it the group is aborted with a reason and its prompt re-issued, at most
  ``rollout.max_reissues`` times;
- ``RUN_DIR/status.json`` (rewritten every heartbeat) says what the scheduler and each worker
  wait for, the open work and whose work is overdue (``scheduler/overdue.py``): the supervisor's
  step watchdog names that role from it;
- a group past its deadline is aborted at its rollout worker too (``AbortGroups``: a workflow's
  episodes are cancelled); a rollout worker that gives up on a group (``GroupAborted``: its workflow
  failed) has it aborted and re-issued; ``Error(workflow_failed)`` (its workflow fails too often)
  fails the run with the workflow's message;
- SIGUSR1 (sent by the supervisor on SIGTERM): stop planning, have the trainer checkpoint the
  last finished step, then shut the fleet down.

The parts beside it: the socket itself, its drain of queued frames, decode and sends (``router.py``),
the worker records and who may send what (``workers.py``), what the run starts from (``start.py``),
``status.json`` and the status report (``status.py``), the metrics rows and the summary
(``step_rows.py``), the checkpoint schedule (``saves.py``). This module is a little over 500 lines
because what is left is one object: the handlers of 15 message types over one set of books.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

import zmq

from protocols.messages import (
    AbortGroups,
    Batch,
    BatchPlan,
    CheckpointRequest,
    CheckpointSaved,
    Error,
    EvalDone,
    GroupAborted,
    GroupsStopped,
    Heartbeat,
    Message,
    Ping,
    Pong,
    Register,
    RegisterAck,
    RewardResult,
    Shutdown,
    StatusRequest,
    TrainerReady,
    TrainStepDone,
    HeldQuery,
    HeldReply,
    TrajectoryReady,
    WeightsLoaded,
    WeightsPublished,
    encode,
    unbatch,
)

from areal_async.config import ExperimentConfig
from areal_async.base.control import worker_of
from areal_async.base.eta import EtaMode
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import Roster
from areal_async.scheduler.router import Router
from areal_async.scheduler.start import open_books
from areal_async.scheduler.status import status_doc, status_report, waiting_for
from areal_async.scheduler.saves import Saves
from areal_async.scheduler.step_rows import StepRows, run_summary
from areal_async.scheduler.weight_updates import WeightUpdates
from areal_async.scheduler.workers import ROLES, WorkerRecord, WorkerTable
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.scheduler")
# messages that change nothing _drive acts on (admission, plans, the stop): no drive after a wakeup of them alone
_PASSIVE = (Heartbeat, Ping, StatusRequest, WeightsLoaded, WeightsPublished)
SHUTDOWN_LINGER_S = 0.2  # at a run's end, at most this for the Shutdown frames to leave (the close waits no more)


class SchedulerService:
    def __init__(
        self,
        cfg: ExperimentConfig,
        endpoints: RunManifest,
        run_dir: str | Path,
        t0: float,
        tokenize,
        roster: Optional[Roster] = None,
    ):
        """``roster``: what the supervisor launched; None (tests of the protocol only) checks no token."""
        self.cfg, self.run_dir, self.t0, self.roster = cfg, Path(run_dir), t0, roster
        self.recoveries = endpoints.recoveries
        self.runlog, self.core, self.prompts, self.task_book, ckpt_state = open_books(
            cfg, endpoints, self.run_dir, tokenize
        )
        self.saves = Saves(cfg.saver, self.core.next_step - 1 if ckpt_state is not None else -1)
        self.stopping = False  # SIGUSR1: final checkpoint, then shut down
        self._status_path = self.run_dir / "status.json"
        self.router = Router(endpoints.control, log)  # the ROUTER socket: drain, decode, send (router.py)
        self.rejections = self.router.rejections
        self._frame: tuple = (None, b"")  # the message being handled and its frame (_take)
        self.workers = WorkerTable()
        # samples accepted from rollout / reward workers, aborted as stale; groups admitted
        self.counts = {"generated": 0, "rewarded": 0, "stale": 0, "admitted": 0, "trajectories_lost": 0}
        self._held_queries = 0  # HeldQuery ids sent; the lost worker of each unanswered one:
        self._held_lost: dict[int, str] = {}
        # frames taken, by message type ("batch:<type>" for a Batch), and the messages the batches carried
        # (summary.json: the run's traffic, the mix benchmarks.data_path replays through this service)
        self.received: dict[str, int] = {}
        self.received_groups: dict[str, int] = {}
        self.latest_weights: Optional[WeightsPublished] = None
        self.weight_updates = WeightUpdates()
        self.done = asyncio.Event()
        self.exit_code = 0
        self.failure = ""  # why the run failed (Error workflow_failed), logged last
        eta = EtaMode.of(cfg).eta
        self.rows = StepRows(self.core, self.counts, self.workers, self.weight_updates, t0, self.task_book, eta)

    # ---- plumbing ------------------------------------------------------------------------
    async def send(self, worker_id: str, msg: Message, data: Optional[bytes] = None) -> None:
        """``msg`` to a registered worker (``data``: its encoding, when one message goes to several)."""
        w = self.workers.get(worker_id)
        if w is None:
            log.error("no worker %r to send %s to", worker_id, msg.TYPE)
            return
        try:
            await self.router.send_frames([w.ident, encode(msg) if data is None else data])
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            log.error("send %s to %s failed: %s", msg.TYPE, worker_id, e)

    def role(self, role: str) -> list[str]:
        return self.workers.role(role)

    async def run(self) -> int:
        self.tasks = tasks = TaskSet()
        tasks.spawn(self._watchdog(), "scheduler.watchdog", forever=True)
        tasks.spawn(self.router.serve(self._take, self._drive), "scheduler.serve", forever=True)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.request_stop)
        try:
            await tasks.wait(self.done)  # raises, with the traceback, if a loop failed
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            tasks.cancel()
            self.runlog.close()
            self.router.close(SHUTDOWN_LINGER_S if self.done.is_set() else 0.0)
        if self.failure:
            log.error("run failed: %s", self.failure)  # the last line: what the supervisor shows first
        return self.exit_code

    async def _take(self, frames: list) -> bool:
        """One frame: decoded (a bad one refused by the router), counted, handled; a refusal answered. False when
        it changed nothing ``_drive`` acts on (a bad frame, ``_PASSIVE``: a heartbeat, weights loaded): no drive."""
        ident, msg = await self.router.decode(frames)
        if msg is None:
            return False
        self._frame = (msg, frames[1])  # the message and its bytes, as checked: a forward sends them unchanged
        key = msg.TYPE if type(msg) is not Batch else f"batch:{msg.kind}"
        self.received[key] = self.received.get(key, 0) + 1
        if type(msg) is Batch:
            self.received_groups[key] = self.received_groups.get(key, 0) + msg.size
        try:
            await self.handle(ident, msg)
        except (ValueError, KeyError) as e:
            why = f"refused {msg.TYPE}"
            self.rejections.reject("scheduler", ident, why, "message %s from %r refused: %s", msg.TYPE, ident, e)
            await self.router.reply_error(ident, "refused", str(e))
        return type(msg) not in _PASSIVE

    # ---- events --------------------------------------------------------------------------
    async def handle(self, ident: bytes, msg: Message) -> None:
        if isinstance(msg, Register):
            return await self._register(ident, msg)
        if isinstance(msg, StatusRequest):  # read-only: any peer that reached the socket (CURVE on tcp) may ask
            return await self._status(ident, msg)
        wid = self.workers.sender(ident, msg, time.monotonic())  # ValueError: not its connection, role, ...
        handler = self._handler_map.get(type(msg))
        if handler is None:
            raise ValueError(f"scheduler does not accept {msg.TYPE!r} messages")
        await handler(wid, msg)

    @functools.cached_property
    def _handler_map(self) -> dict:
        """Message class -> handler, built once (not per message)."""
        return {
            Heartbeat: self._heartbeat,
            Ping: self._ping,
            Batch: self._batch,
            TrajectoryReady: self._trajectory,
            RewardResult: self._reward,
            WeightsPublished: self._weights_published,
            WeightsLoaded: self._weights_loaded,
            TrainerReady: self._trainer_ready,
            TrainStepDone: self._step_done,
            Error: self._worker_error,
            GroupAborted: self._group_aborted,
            GroupsStopped: self._groups_stopped,
            EvalDone: self._eval_done,
            CheckpointSaved: self._checkpoint_saved,
            HeldReply: self._held_reply,
        }

    async def _batch(self, wid: str, m: Batch) -> None:
        """Several messages of one type (an engine step's groups, a reward worker's scores): each handled as
        if it had come alone (the sender's role was checked for their type); generated groups and scores are
        booked from the batch's columns, item by item in order, with no message object an item."""
        if m.kind == "trajectory_ready":
            return self._generated_columns(wid, m.columns)
        if m.kind == "reward_result":
            return self._scored_columns(wid, m.columns)
        handler = self._handler_map.get(m.item_type)
        if handler is None or handler == self._batch:
            raise ValueError(f"scheduler does not accept {m.kind!r} messages")
        for item in m.items():
            await handler(wid, item)

    async def _heartbeat(self, wid: str, msg: Heartbeat) -> None:
        self.workers[wid].stats = msg.stats

    async def _ping(self, wid: str, msg: Ping) -> None:
        if wid in self.workers:
            await self.send(wid, Pong(nonce=msg.nonce))

    async def _status(self, ident: bytes, m: StatusRequest) -> None:
        report = status_report(
            m.nonce,
            self.core,
            self.workers,
            self.counts,
            total_steps=self.cfg.total_train_steps,
            finished=self.done.is_set(),
            wall_s=time.time() - self.t0,
            heartbeat_s=self.cfg.cluster.heartbeat_s,
            overdue_now=self._status_doc()["overdue"],
            weight_update=self.weight_updates.last,
        )
        failed = await self.router.send_to(ident, report)
        if failed is not None:
            log.warning("status reply to %r failed: %s", ident, failed)

    async def _register(self, ident: bytes, m: Register) -> None:
        if m.role not in ROLES:
            raise ValueError(f"register: role {m.role!r} is not {' | '.join(ROLES)}")
        if worker_of(ident) != m.worker_id:
            raise ValueError(f"register: socket identity {ident!r} differs from worker_id {m.worker_id!r}")
        if self.roster is not None and (why := self.roster.check(m.role, m.worker_id, m.token)):
            text = "refused a registration as %s %s (pid %d, host %r): %s"
            self.rejections.reject("scheduler", ident, "registration", text, m.role, m.worker_id, m.pid, m.host, why)
            raise ValueError(f"register: {why}")
        old = self.workers.get(m.worker_id)
        if old is not None:
            if old.role != m.role:
                raise ValueError(f"register: {m.worker_id!r} is registered as a {old.role} worker, not {m.role}")
            # a restarted worker (new pid, same id): what its old incarnation held is gone
            await self._lose(m.worker_id, f"restarted (pid {old.pid} -> {m.pid})", tell=False)
        self.workers.add(m.worker_id, m.role, ident, m.pid, m.host, time.monotonic())
        log.info("registered %s %s (pid %d, host %r, by its own account)", m.role, m.worker_id, m.pid, m.host)
        await self.send(m.worker_id, RegisterAck(worker_id=m.worker_id, version=self.core.version))
        if self.done.is_set():  # a worker restarted just as the run ended: nothing left for it
            await self.send(m.worker_id, Shutdown(reason="run finished"))
            return
        if m.role == "rollout":
            self.core.add_rollout(m.worker_id)
            if self.latest_weights is not None:
                await self.send(m.worker_id, self.latest_weights)

    async def _trajectory(self, wid: str, m: TrajectoryReady) -> None:
        c = m.__dict__  # a message's fields under the names a batch's columns have
        self._generated_columns(wid, {k: [v] for k, v in c.items()})

    def _generated_columns(self, wid: str, c: dict) -> None:
        """The groups of ``TrajectoryReady`` columns, in order; a sample count for each group taken whole."""
        on_generated, n = self.core.on_generated, 0
        per_group = zip(c["sample_ids"], c["n_output_tokens"], c["version_min"], c["version_max"], c["finish_reasons"])
        for gid, (sids, *fields), turns in zip(c["group_id"], per_group, c["turns"]):
            why = on_generated(gid, sids, *fields, turns)
            if why:
                log.warning("ignored trajectory from %s: %s", wid, why)
            else:
                n += len(sids)
        self._count(wid, "generated", n)

    async def _reward(self, wid: str, m: RewardResult) -> None:
        self._scored_columns(wid, {k: [v] for k, v in m.__dict__.items()})

    def _scored_columns(self, wid: str, c: dict) -> None:
        """The groups of ``RewardResult`` columns, in order (a rollout worker's only for groups it holds: the
        first it does not hold is refused, those before it stay booked and counted)."""
        on_scored, groups, n = self.core.on_scored, self.core.ledger.groups, 0
        from_rollout = self.workers[wid].role == "rollout"  # a workflow's own rewards
        try:
            for gid, sids, scores, statuses in zip(c["group_id"], c["sample_ids"], c["scores"], c["statuses"]):
                if from_rollout:
                    _check_holds(wid, gid, groups.get(gid))
                why = on_scored(gid, sids, scores, statuses)
                if why:
                    log.warning("ignored reward from %s: %s", wid, why)
                else:
                    n += len(sids)
        finally:
            self._count(wid, "rewarded", n)

    def _count(self, wid: str, what: str, n: int) -> None:
        """Samples a worker delivered (per worker: status throughput; in total: the metrics rows)."""
        self.counts[what] += n
        self.workers[wid].samples += n

    async def _weights_published(self, wid: str, m: WeightsPublished) -> None:
        self.latest_weights = m
        self.weight_updates.published(m.version, m.t_ready, m.t_sent)
        msg, frame = self._frame  # the trainer's frame, checked by decode: forwarded as it came, to every rollout
        data = bytes(frame) if msg is m else encode(m)
        for r in self.role("rollout"):
            await self.send(r, m, data)

    async def _weights_loaded(self, wid: str, m: WeightsLoaded) -> None:
        self.core.on_weights_loaded(wid, m.version)
        done = self.weight_updates.loaded(wid, m.version, m.times, self.workers.ids("rollout"))
        if done:
            log.info(
                "weights v%d: every rollout generates with them %.3fs after the optimizer step",
                m.version,
                done["weight_update_s"],
            )

    async def _trainer_ready(self, wid: str, m: TrainerReady) -> None:
        log.info("trainer ready at version %d, next step %d", m.version, m.next_step)
        if (m.version, m.next_step) != (self.core.version, self.core.next_step) and self.core.next_step > 0:
            raise ValueError(
                f"trainer resumed at version {m.version}, step {m.next_step}; the scheduler's books are "
                f"at version {self.core.version}, step {self.core.next_step}"
            )
        self.core.on_trainer_ready(m.version, m.next_step)
        if self.core.finished:
            await self._finish()

    async def _worker_error(self, wid: str, m: Error) -> None:
        log.error("worker %s reported %s: %s", wid, m.code, m.detail)
        if m.code == "workflow_failed" and self.workers[wid].role == "rollout" and not self.done.is_set():
            await self._fail(f"{wid}: {m.detail}")

    async def _fail(self, why: str) -> None:
        """End the run non-zero with ``why`` (the supervisor prints this log's tail): every worker is told."""
        log.error("run failed: %s", why)
        self.exit_code, self.failure = 1, why
        for w in list(self.workers):
            await self.send(w, Shutdown(reason=f"run failed: {why}"))
        self.done.set()

    async def _group_aborted(self, wid: str, m: GroupAborted) -> None:
        """A rollout worker could not generate a group it holds (its workflow failed): abort, re-issue."""
        g = self.core.ledger.groups.get(m.group_id)
        if g is None or g.worker != wid:
            raise ValueError(f"rollout worker {wid!r} aborted group {m.group_id!r}, which it does not hold")
        recs = self.core.abort_running(m.group_id, f"workflow_error: {m.reason}")
        log.warning("group %s aborted by %s (%d samples): %s", m.group_id, wid, len(recs), m.reason[:300])

    async def _groups_stopped(self, wid: str, m: GroupsStopped) -> None:
        """Aborted groups its engine stopped mid-generation: their tokens are wasted (long_tail.py)."""
        self.core.on_stopped(m.n_output_tokens)

    async def _step_done(self, wid: str, m: TrainStepDone) -> None:
        trained = self.core.on_step_done(m.step, m.version, m.skipped_ids)
        self.runlog.metrics(self.rows.row(m, trained))
        self.core.ledger.forget_final()
        if self.core.finished:
            if self.cfg.saver.freq_steps or self.cfg.saver.freq_secs:
                await self._request_checkpoint(m.step)  # the final weights too (saved before the trainer's Shutdown)
            await self._finish()
        elif self.saves.due(m.step) and not self.stopping and not self.core.trainer_busy:
            # busy: step m.step + 1 was planned ahead before a time-based save fell due; it is
            # still due after that step (plan ahead is off meanwhile, see _may_plan_ahead)
            await self._request_checkpoint(m.step)

    async def _eval_done(self, wid: str, m: EvalDone) -> None:
        """The periodic evaluator's row: kind 'eval', step = trainer steps behind this version."""
        self.runlog.metrics(
            {"kind": "eval", "step": m.version, "version": m.version, **m.metrics, "wall_s": time.time() - self.t0}
        )

    async def _request_checkpoint(self, step: int) -> None:
        """The trainer saves weights + optimizer with this state before it trains the next step."""
        state = self.core.state() | {"offsets": self.runlog.offsets(), "n_sample_lines": self.runlog.n_sample_lines}
        if self.task_book is not None:
            state["tasks"] = self.task_book.state()
        self.saves.asked(step)
        for t in self.role("trainer"):
            await self.send(t, CheckpointRequest(step=step, state=state))

    async def _checkpoint_saved(self, wid: str, m: CheckpointSaved) -> None:
        log.info("checkpoint after step %d saved at %s", m.step, m.path)
        self.saves.confirmed(m.step)

    # ---- stopping on a signal: final checkpoint first -----------------------------------
    def request_stop(self) -> None:
        """SIGUSR1 (the supervisor got SIGTERM/SIGINT): no new plans or groups; the trainer saves
        the last finished step (unless saved already); then Shutdown to everyone."""
        if not self.stopping:
            log.info("stop requested: final checkpoint after step %d, then shutdown", self.core.next_step - 1)
            self.stopping = True
            self.tasks.spawn(self._drive(), "scheduler.stop")

    async def _drive_stop(self) -> None:
        if self.core.trainer_busy or self.saves.pending is not None or self.done.is_set():
            return  # the step in progress ends first; a requested checkpoint is confirmed first
        last = self.core.next_step - 1
        if last > self.saves.saved and self.role("trainer") and self.cfg.mode != "rollout_only":  # nothing learnt
            await self._request_checkpoint(last)
            return
        log.info("stopping: last finished step %d is checkpointed (or none was trained)", last)
        for w in list(self.workers):
            await self.send(w, Shutdown(reason="stopped by signal after the final checkpoint"))
        self.done.set()

    # ---- driving the core ----------------------------------------------------------------
    async def _drive(self) -> None:
        if self.stopping:
            if self.core.short_steps:  # the trainer holds a plan that waits for its revision: it ends first
                await self._plan_and_admit(only_short=True)
            return await self._drive_stop()
        starved = self.core.filter_starved()
        if starved and not self.done.is_set():
            return await self._fail(starved)
        await self._plan_and_admit()

    async def _plan_and_admit(self, only_short: bool = False) -> None:
        """Send the plans the core makes, then the groups it admits (``only_short``: see ``core.admit``)."""
        for _ in range(3):  # revisions (on_missing), the trainer's next step, (η >= 1) the one after it
            plan, stale = self.core.plan(ahead=self._may_plan_ahead() and not only_short)
            if stale:
                log.info("aborted %d stale samples (re-issued)", len(stale))
                self.counts["stale"] += len(stale)
            if plan is None:
                break
            await self._send_plan(plan)
        await self._stop_at_workers(self.core.cut_stragglers(), "straggler")  # rollout.over_provision
        for worker, batch in self.core.admit_batches(only_short).items():  # one message a worker
            self.counts["admitted"] += batch.size
            await self.send(worker, batch if batch.size > 1 else unbatch(batch)[0])

    def _may_plan_ahead(self) -> bool:
        """Plan step n+1 while step n trains (η >= 1, the core checks it) unless a checkpoint
        after step n is pending or due: it must be saved with the books between steps n and n+1,
        before the trainer takes step n+1 off its queue."""
        return self.saves.pending is None and not self.saves.due(self.core.next_step)

    async def _send_plan(self, plan: BatchPlan) -> None:
        trainers = self.role("trainer")
        if not trainers:
            raise RuntimeError("a batch was planned but no trainer is registered")
        if plan.revision:
            log.warning(
                "step %d's plan revised (revision %d): %d groups", plan.step, plan.revision, len(set(plan.group_ids))
            )
        else:
            self.rows.plan_at[plan.step] = time.time()
        await self.send(trainers[0], plan)

    async def _finish(self) -> None:
        aborted = self.core.abort_open("run_end: the run reached total_train_steps before this sample was trained")
        summary = run_summary(self.core, self.runlog, self.prompts, len(aborted), self.t0) | {
            "recoveries": self.recoveries,
            "messages_received": dict(sorted(self.received.items())),
            "groups_in_batched_messages": dict(sorted(self.received_groups.items())),
        }
        self.runlog.summary(summary)
        log.info("run finished: %s", summary)
        for w in list(self.workers):
            await self.send(w, Shutdown(reason="run finished"))
        self.done.set()

    # ---- liveness ------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            self._write_status()
            self.rejections.flush_due()
            await asyncio.sleep(self.cfg.cluster.heartbeat_s)
            await self._check_heartbeats()
            await self._expire_groups()

    async def _check_heartbeats(self) -> None:
        now = time.monotonic()
        timeout = self.cfg.cluster.worker_timeout_s
        for wid, silent in self.workers.silent(now, timeout):
            await self._lose(wid, f"no heartbeat for {silent:.0f}s (cluster.worker_timeout_s={timeout:g})")

    async def _expire_groups(self) -> None:
        expired = self.core.expire()
        if expired:
            reasons = sorted({r.reason for r in expired})
            log.warning("%d samples past their deadline aborted: %s", len(expired), "; ".join(reasons)[:500])
            await self._stop_at_workers(expired, "deadline")
            await self._drive()

    async def _stop_at_workers(self, aborted: list, reason: str) -> None:
        """The groups of these aborted records stop at the rollout workers holding them (``AbortGroups``:
        the engine drops them, a workflow's episodes are cancelled)."""
        by_worker: dict[str, list[str]] = {}
        for r in aborted:
            if r.worker in self.workers and r.group_id not in by_worker.get(r.worker, []):
                by_worker.setdefault(r.worker, []).append(r.group_id)
        for worker, gids in by_worker.items():
            await self.send(worker, AbortGroups(group_ids=gids, reason=reason))

    async def _lose(self, wid: str, why: str, tell: bool = True) -> None:
        """Forget a worker and re-issue its work. ``tell``: it may still be alive (timed out, not
        restarted): it gets ``Shutdown(lost=True)`` and a line in lost.jsonl, so the supervisor
        kills it if it does not exit; whatever it sends later is refused as unregistered."""
        log.error("worker %s lost: %s", wid, why)
        w = self.workers.pop(wid)
        if tell:
            self._record_lost(wid, w, why)
            await self.router.send_to(w.ident, Shutdown(reason=f"lost: {why}", lost=True))  # gone already: fine
        if w.role == "trainer":
            self.core.trainer_ready = False  # no plan can be sent; the supervisor fails or recovers the run
            log.error("the trainer is lost: no further steps in this fleet")
        lose = {"rollout": self.core.lose_worker, "reward": self.core.lose_reward_worker}.get(w.role)
        if lose is not None:
            lose(wid, why)
            if w.role == "rollout":
                await self._ask_held(wid)
            await self._drive()

    async def _ask_held(self, wid: str) -> None:
        """A lost rollout worker's generated groups: the trainer says which of their tensors it never got."""
        sids = self.core.unconfirmed(wid)
        trainers = self.role("trainer")
        if not sids or not trainers:  # no trainer: its replacement resumes from a checkpoint, books and all
            return
        self._held_queries += 1
        self._held_lost[self._held_queries] = wid
        await self.send(trainers[0], HeldQuery(query_id=self._held_queries, worker_id=wid, sample_ids=sids))

    async def _held_reply(self, wid: str, m: HeldReply) -> None:
        lost = self._held_lost.pop(m.query_id, None)
        if lost is None:
            raise ValueError(f"HeldReply to query {m.query_id}, which the scheduler did not send (or already answered)")
        if not m.missing_ids:
            return
        why = f"trajectories_lost: the tensors never reached the trainer (rollout worker {lost} died first)"
        recs = self.core.on_missing(m.missing_ids, why)
        self.counts["trajectories_lost"] += len(recs)
        log.warning("%d samples of lost worker %s never reached the trainer: aborted, re-issued", len(recs), lost)
        await self._drive()

    def _record_lost(self, wid: str, w: WorkerRecord, why: str) -> None:
        line = {"worker": wid, "role": w.role, "pid": w.pid, "why": why, "wall_s": time.time() - self.t0}
        with open(self.run_dir / "lost.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _write_status(self) -> None:
        """What everyone waits for, for the supervisor's step watchdog (atomic rewrite)."""
        tmp = self._status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._status_doc()))
        os.replace(tmp, self._status_path)

    def _status_doc(self) -> dict:
        return status_doc(self.core, self.workers, self.rows, self.waiting_for(), self.t0, self.cfg.cluster.heartbeat_s)

    def waiting_for(self) -> str:
        """The scheduler's view of what the next trainer step waits for."""
        return waiting_for(self.core, bool(self.role("trainer")), self.rows, self.stopping)


def _check_holds(wid: str, gid: str, g) -> None:
    """ValueError unless rollout worker ``wid`` holds group ``gid`` (its record ``g``; None: unknown)."""
    if g is None or g.worker != wid:
        raise ValueError(
            f"rollout worker {wid!r} sent rewards for group {gid!r}, which it does not "
            f"hold ({'unknown group' if g is None else 'held by ' + repr(g.worker)})"
        )
