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
import zmq.asyncio

from protocols.messages import (
    AbortGroups,
    BatchPlan,
    CheckpointRequest,
    CheckpointSaved,
    Error,
    EvalDone,
    GenerateRequest,
    GenerateRequests,
    GroupAborted,
    Heartbeat,
    Message,
    Ping,
    Pong,
    Register,
    RegisterAck,
    RewardResult,
    RewardResults,
    Shutdown,
    StatusReport,
    StatusRequest,
    TrainerReady,
    TrainStepDone,
    TrajectoriesReady,
    TrajectoryReady,
    WeightsLoaded,
    WeightsPublished,
)
from protocols.rejections import RejectionLog
from protocols.sockets import decode_logged, make_socket, send_message

from areal_async.config import ExperimentConfig
from areal_async.data.gym import GymSource
from areal_async.data.prompts import LengthFilter, PromptCursor, keep_short, load_problems
from areal_async.base.control import worker_of
from areal_async.base.endpoints import Endpoints
from areal_async.base.runkeys import Roster
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.group_filter import build_group_filter
from areal_async.scheduler.health import IdleMeter, sample_health, trainer_idle
from areal_async.scheduler.overdue import open_work, overdue
from areal_async.scheduler.runlog import RunLog
from areal_async.scheduler.sinks import sinks_from_config
from areal_async.scheduler.task_book import PromptTable, TaskBook
from areal_async.scheduler.weight_updates import WeightUpdates, metrics_columns
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.scheduler")


def build_core(
    cfg: ExperimentConfig, tokenize, runlog: RunLog
) -> tuple[SchedulerCore, LengthFilter, Optional[TaskBook]]:
    """The core over the problems within ``train_dataset.max_prompt_len`` (counted and logged here, at start),
    and for a reasoning-gym mixture its per-task books (``task_book.py``)."""
    d = cfg.train_dataset
    source = GymSource.from_config(d, cfg.seed) if d.type == "reasoning_gym" else None
    problems = source.problems() if source is not None else load_problems(d, cfg.seed)
    lengths = keep_short(problems, tokenize, d.max_prompt_len)
    log.info("train_dataset: %s", lengths.describe())
    kept = [problems[i] for i in lengths.kept]
    book = None if source is None else TaskBook(source, lengths.kept, kept, tokenize, d.max_prompt_len, d.curriculum)
    problem = book.table if book is not None else PromptTable(kept, tokenize, lambda i: 0)
    g = cfg.gconfig
    params = SchedulerParams(
        batch_size=cfg.train_dataset.batch_size,
        n_samples=g.n_samples,
        eta=cfg.rollout.max_head_offpolicyness,
        total_steps=cfg.total_train_steps,
        max_concurrent=cfg.rollout.max_concurrent_rollouts,
        gen=dict(
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            greedy=g.greedy,
            stop_token_ids=list(g.stop_token_ids),
        ),
        gen_deadline_s=cfg.rollout.gen_deadline_s,
        reward_deadline_s=cfg.reward.deadline_s,
        max_reissues=cfg.rollout.max_reissues,
        group_filter=build_group_filter(cfg.rollout.dynamic_filter),
        filter_max_gen_batches=cfg.rollout.dynamic_filter_max_gen_batches,
    )
    cursor = PromptCursor(len(lengths.kept), cfg.seed, d.shuffle)
    return SchedulerCore(params, cursor, problem, log_sample=runlog.sample), lengths, book


# heartbeat stats copied into status.json for the overdue attribution (scheduler/overdue.py)
_STATUS_STATS = ("engine_step_s", "episodes", "episode_oldest_s", "workflow", "scoring_oldest_s")
DRAIN_MAX = 256  # frames handled per wakeup before the core is driven (admit, plan) once
_SENDERS = {
    TrajectoryReady: ("rollout",),
    TrajectoriesReady: ("rollout",),
    WeightsLoaded: ("rollout",),
    GroupAborted: ("rollout",),
    RewardResult: ("reward", "rollout"),
    RewardResults: ("reward",),
    WeightsPublished: ("trainer",),
    TrainerReady: ("trainer",),
    TrainStepDone: ("trainer",),
    EvalDone: ("trainer",),
    CheckpointSaved: ("trainer",),
}


def next_attempt(run_dir: Path) -> int:
    """How many times a scheduler started in ``run_dir`` before (``RUN_DIR/resumes.json``, 0 when
    none): the id prefix of a resumed or restarted run is at least this, so ids never repeat."""
    path = Path(run_dir) / "resumes.json"
    if not path.exists():
        return 0
    return int(json.loads(path.read_text())["resumes"]) + 1


def save_attempt(run_dir: Path, resumes: int) -> None:
    tmp = Path(run_dir) / "resumes.json.tmp"
    tmp.write_text(json.dumps({"resumes": resumes}) + "\n")
    tmp.replace(Path(run_dir) / "resumes.json")


def _checkpoint_state(path: str) -> dict:
    state = json.loads((Path(path) / "extra.json").read_text())
    missing = {"version", "next_step", "cursor", "ledger", "offsets", "n_sample_lines"} - set(state)
    if missing:
        raise ValueError(f"checkpoint {path} lacks scheduler state {sorted(missing)}")
    return state


class SchedulerService:
    def __init__(
        self,
        cfg: ExperimentConfig,
        endpoints: Endpoints,
        run_dir: str | Path,
        t0: float,
        tokenize,
        roster: Optional[Roster] = None,
    ):
        """``roster``: what the supervisor launched; None (tests of the protocol only) checks no token."""
        self.cfg, self.run_dir, self.t0, self.roster = cfg, Path(run_dir), t0, roster
        self.recoveries = int(endpoints.extra.get("recoveries", 0))
        resume = endpoints.extra.get("resume_from")
        ckpt_state = _checkpoint_state(resume) if resume else None
        if ckpt_state is not None or cfg.recover.mode != "disabled":
            # a resumed run continues the books from the checkpoint (nothing, if there is none)
            cut = RunLog.rollback(run_dir, ckpt_state["offsets"] if ckpt_state else {})
            log.info("resuming from %s; rolled back %s lines written after it", resume, cut)
        self.runlog = RunLog(run_dir, cfg.rollout.dump_to_file, sinks_from_config(cfg, run_dir))
        self.core, self.prompts, self.task_book = build_core(cfg, tokenize, self.runlog)
        attempt = next_attempt(self.run_dir)
        if ckpt_state is None and attempt:
            self.core.restart_ids(attempt)  # a restart from nothing: the books were cut to empty
        if ckpt_state is not None:
            self.runlog.n_sample_lines = int(ckpt_state["n_sample_lines"])
            recovered = self.core.restore(ckpt_state, at_least=attempt)
            if self.task_book is not None:
                self.task_book.restore(ckpt_state.get("tasks"))
            log.info(
                "restored step %d, version %d; %d in-flight samples aborted and re-issued",
                self.core.next_step,
                self.core.version,
                len(recovered),
            )
        save_attempt(self.run_dir, self.core.resumes)  # before any id is issued
        self._last_save = time.monotonic()
        # checkpoints: the newest one confirmed saved (the resumed one counts), one asked for and not yet confirmed
        self._ckpt_saved = self.core.next_step - 1 if ckpt_state is not None else -1
        self._ckpt_pending: Optional[int] = None
        self.stopping = False  # SIGUSR1: final checkpoint, then shut down
        self._status_path = self.run_dir / "status.json"
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=endpoints.control)
        self.queued = zmq.Socket.shadow(self.sock.underlying)  # the same socket, read without a Future per frame
        self.rejections = RejectionLog(log)  # bad frames and refusals: rate-limited lines, a count per peer a minute
        self.workers: dict[str, dict] = {}  # worker_id -> {role, ident, last_seen, pid, host, samples, ...}
        # samples accepted from rollout / reward workers, aborted as stale; groups admitted
        self.counts = {"generated": 0, "rewarded": 0, "stale": 0, "admitted": 0}
        self.registrations: dict[str, int] = {}  # worker_id -> times registered (a lost worker's entry stays)
        # frames taken, by message type, and the groups the batched ones carried (summary.json: the
        # run's traffic, the mix benchmarks.data_path replays through this service)
        self.received: dict[str, int] = {}
        self.received_groups: dict[str, int] = {}
        self.latest_weights: Optional[WeightsPublished] = None
        self.weight_updates = WeightUpdates()
        self.done = asyncio.Event()
        self.exit_code = 0
        self.failure = ""  # why the run failed (Error workflow_failed), logged last
        self._step_t = time.time()
        self._filter_last = {"groups": 0, "samples": 0, "errors": 0}  # rollout.dynamic_filter's counts at the last row
        self._scored_last = [0.0, 0]  # core.scored at the last row
        self._idle = {"rollout": IdleMeter(), "reward": IdleMeter()}  # health.py's idle fractions
        self._plan_at: dict[int, float] = {}  # step -> time its BatchPlan was sent (two with plan ahead)

    # ---- plumbing ------------------------------------------------------------------------
    async def send(self, worker_id: str, msg: Message) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            log.error("no worker %r to send %s to", worker_id, msg.TYPE)
            return
        try:
            await send_message(self.sock, msg, to=w["ident"])
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            log.error("send %s to %s failed: %s", msg.TYPE, worker_id, e)

    def role(self, role: str) -> list[str]:
        return [w for w, v in self.workers.items() if v["role"] == role]

    async def run(self) -> int:
        self.tasks = tasks = TaskSet()
        tasks.spawn(self._watchdog(), "scheduler.watchdog", forever=True)
        tasks.spawn(self._serve(), "scheduler.serve", forever=True)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.request_stop)
        try:
            await tasks.wait(self.done)  # raises, with the traceback, if a loop failed
            await asyncio.sleep(0.2)  # let the Shutdown frames leave
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            tasks.cancel()
            self.rejections.flush()
            self.runlog.close()
            self.sock.close(0)
            self.ctx.term()
        if self.failure:
            log.error("run failed: %s", self.failure)  # the last line: what the supervisor shows first
        return self.exit_code

    async def _serve(self) -> None:
        """Per wakeup: the frame that woke us and those already queued behind it (up to
        ``DRAIN_MAX``, taken without waiting), each handled in order; then one ``_drive``."""
        while True:
            frames, n = await self.sock.recv_multipart(), 0
            while frames is not None:
                await self._take(frames)
                n += 1
                frames = self._queued_frames() if n < DRAIN_MAX else None
            await self._drive()

    def _queued_frames(self) -> Optional[list]:
        """A frame already queued, or None. Read through the synchronous shadow of the socket: the
        asyncio socket would do the same read wrapped in a Future (about 2 us a frame); the next
        ``await self.sock.recv_multipart()`` checks the socket's events first, so nothing is missed."""
        try:
            return self.queued.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def _take(self, frames: list) -> None:
        ident, msg = decode_logged(frames, routed=True, where="scheduler", rejections=self.rejections)
        if msg is None:
            return await self._reply_error(ident, "bad_frame", "frame rejected; see scheduler log")
        self.received[msg.TYPE] = self.received.get(msg.TYPE, 0) + 1
        if isinstance(msg, (TrajectoriesReady, RewardResults)):
            self.received_groups[msg.TYPE] = self.received_groups.get(msg.TYPE, 0) + len(msg.group_ids)
        try:
            await self.handle(ident, msg)
        except (ValueError, KeyError) as e:
            why = f"refused {msg.TYPE}"
            self.rejections.reject("scheduler", ident, why, "message %s from %r refused: %s", msg.TYPE, ident, e)
            await self._reply_error(ident, "refused", str(e))

    async def _reply_error(self, ident: Optional[bytes], code: str, detail: str) -> None:
        if ident is not None:
            try:
                await send_message(self.sock, Error(code=code, detail=detail), to=ident)
            except zmq.ZMQError:
                pass  # sender vanished: nothing to tell

    # ---- events --------------------------------------------------------------------------
    async def handle(self, ident: bytes, msg: Message) -> None:
        if isinstance(msg, Register):
            return await self._register(ident, msg)
        if isinstance(msg, StatusRequest):  # read-only: any peer that reached the socket (CURVE on tcp) may ask
            return await self._status(ident, msg)
        wid = worker_of(ident)
        if wid in self.workers and self.workers[wid]["ident"] != ident:
            raise ValueError(f"{msg.TYPE} from {ident!r}, which is not the connection that registered as {wid!r}")
        if wid not in self.workers and not isinstance(msg, Ping):
            raise ValueError(f"{msg.TYPE} from unregistered peer {wid!r}")
        if wid in self.workers:
            self.workers[wid]["last_seen"] = time.monotonic()
        handler = self._handler_map.get(type(msg))
        if handler is None:
            raise ValueError(f"scheduler does not accept {msg.TYPE!r} messages")
        allowed = _SENDERS.get(type(msg))
        if allowed and self.workers[wid]["role"] not in allowed:
            raise ValueError(
                f"a {self.workers[wid]['role']} worker may not send {msg.TYPE!r} (only {' | '.join(allowed)})"
            )
        await handler(wid, msg)

    @functools.cached_property
    def _handler_map(self) -> dict:
        """Message class -> handler, built once (not per message)."""
        return {
            Heartbeat: self._heartbeat,
            Ping: self._ping,
            TrajectoryReady: self._trajectory,
            TrajectoriesReady: self._trajectories,
            RewardResult: self._reward,
            RewardResults: self._rewards,
            WeightsPublished: self._weights_published,
            WeightsLoaded: self._weights_loaded,
            TrainerReady: self._trainer_ready,
            TrainStepDone: self._step_done,
            Error: self._worker_error,
            GroupAborted: self._group_aborted,
            EvalDone: self._eval_done,
            CheckpointSaved: self._checkpoint_saved,
        }

    async def _heartbeat(self, wid: str, msg: Heartbeat) -> None:
        self.workers[wid]["stats"] = msg.stats

    async def _ping(self, wid: str, msg: Ping) -> None:
        if wid in self.workers:
            await self.send(wid, Pong(nonce=msg.nonce))

    async def _status(self, ident: bytes, m: StatusRequest) -> None:
        c, now = self.core, time.monotonic()
        report = StatusReport(
            nonce=m.nonce,
            version=c.version,
            next_step=c.next_step,
            total_steps=self.cfg.total_train_steps,
            finished=self.done.is_set(),
            wall_s=time.time() - self.t0,
            admitted=self.counts["admitted"],
            running=c.running,
            ready=len(c.ready),
            stale=self.counts["stale"],
            samples_trained=c.ledger.n_trained,
            samples_aborted=c.ledger.n_aborted,
            workers=[self._worker_status(w, now) for w in sorted(self.workers)],
            overdue=self._status_doc()["overdue"],
            weight_update=self.weight_updates.last,
        )
        try:
            await send_message(self.sock, report, to=ident)
        except zmq.ZMQError as e:
            log.warning("status reply to %r failed: %s", ident, e)

    def _worker_status(self, wid: str, now: float) -> dict:
        w = self.workers[wid]
        samples = self.core.ledger.n_trained if w["role"] == "trainer" else w.get("samples", 0)
        silent = now - w["last_seen"]
        versions = {"rollout": getattr(self.core.rollouts.get(wid), "loaded_version", -1), "trainer": self.core.version}
        return {
            "worker_id": wid,
            "role": w["role"],
            "pid": w["pid"],
            "host": w.get("host", ""),
            "state": "alive" if silent <= 2 * self.cfg.cluster.heartbeat_s else "silent",
            "version": versions.get(w["role"], -1),
            "samples": samples,
            "samples_per_s": samples / max(1e-9, now - w.get("since", now)),
            "restarts": self.registrations.get(wid, 1) - 1,
            "silent_s": silent,
        }

    async def _register(self, ident: bytes, m: Register) -> None:
        if m.role not in ("rollout", "reward", "trainer"):
            raise ValueError(f"register: role {m.role!r} is not rollout | reward | trainer")
        if worker_of(ident) != m.worker_id:
            raise ValueError(f"register: socket identity {ident!r} differs from worker_id {m.worker_id!r}")
        if self.roster is not None and (why := self.roster.check(m.role, m.worker_id, m.token)):
            text = "refused a registration as %s %s (pid %d, host %r): %s"
            self.rejections.reject("scheduler", ident, "registration", text, m.role, m.worker_id, m.pid, m.host, why)
            raise ValueError(f"register: {why}")
        old = self.workers.get(m.worker_id)
        if old is not None:
            if old["role"] != m.role:
                raise ValueError(f"register: {m.worker_id!r} is registered as a {old['role']} worker, not {m.role}")
            # a restarted worker (new pid, same id): what its old incarnation held is gone
            await self._lose(m.worker_id, f"restarted (pid {old.get('pid')} -> {m.pid})", tell=False)
        self.workers[m.worker_id] = {
            "role": m.role,
            "ident": ident,
            "last_seen": time.monotonic(),
            "pid": m.pid,
            "host": m.host,
            "since": time.monotonic(),
        }
        self.registrations[m.worker_id] = self.registrations.get(m.worker_id, 0) + 1  # restarts = this - 1
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
        why = self.core.on_trajectory(m)
        if why:
            log.warning("ignored trajectory from %s: %s", wid, why)
        else:
            self._count(wid, "generated", len(m.sample_ids))

    async def _trajectories(self, wid: str, m: TrajectoriesReady) -> None:
        """The groups of one engine step: each booked as its own TrajectoryReady."""
        for g in m.groups():
            await self._trajectory(wid, g)

    async def _reward(self, wid: str, m: RewardResult) -> None:
        if self.workers[wid]["role"] == "rollout":  # a workflow's own rewards: only for the groups it holds
            g = self.core.ledger.groups.get(m.group_id)
            if g is None or g.worker != wid:
                raise ValueError(
                    f"rollout worker {wid!r} sent rewards for group {m.group_id!r}, which it does not "
                    f"hold ({'unknown group' if g is None else 'held by ' + repr(g.worker)})"
                )
        why = self.core.on_reward(m)
        if why:
            log.warning("ignored reward from %s: %s", wid, why)
        else:
            self._count(wid, "rewarded", len(m.sample_ids))

    async def _rewards(self, wid: str, m: RewardResults) -> None:
        """Several groups' scores from a reward worker: each group booked as its own RewardResult."""
        for result in m.results():
            await self._reward(wid, result)

    def _count(self, wid: str, what: str, n: int) -> None:
        """Samples a worker delivered (per worker: status throughput; in total: the metrics rows)."""
        self.counts[what] += n
        self.workers[wid]["samples"] = self.workers[wid].get("samples", 0) + n

    async def _weights_published(self, wid: str, m: WeightsPublished) -> None:
        self.latest_weights = m
        self.weight_updates.published(m.version, m.t_ready, m.t_sent)
        for r in self.role("rollout"):
            await self.send(r, m)

    async def _weights_loaded(self, wid: str, m: WeightsLoaded) -> None:
        self.core.on_weights_loaded(wid, m.version)
        done = self.weight_updates.loaded(wid, m.version, m.times, self.role("rollout"))
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
        if m.code == "workflow_failed" and self.workers[wid]["role"] == "rollout" and not self.done.is_set():
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

    async def _step_done(self, wid: str, m: TrainStepDone) -> None:
        trained = self.core.on_step_done(m.step, m.version, m.skipped_ids)
        self.runlog.metrics(self._metrics_row(m, trained))
        self.core.ledger.forget_final()
        if self.core.finished:
            if self.cfg.saver.freq_steps or self.cfg.saver.freq_secs:
                await self._request_checkpoint(m.step)  # the final weights too (saved before the trainer's Shutdown)
            await self._finish()
        elif self._save_due(m.step) and not self.stopping and not self.core.trainer_busy:
            # busy: step m.step + 1 was planned ahead before a time-based save fell due; it is
            # still due after that step (plan ahead is off meanwhile, see _may_plan_ahead)
            await self._request_checkpoint(m.step)

    async def _eval_done(self, wid: str, m: EvalDone) -> None:
        """The periodic evaluator's row: kind 'eval', step = trainer steps behind this version."""
        self.runlog.metrics(
            {"kind": "eval", "step": m.version, "version": m.version, **m.metrics, "wall_s": time.time() - self.t0}
        )

    def _save_due(self, step: int) -> bool:
        sv = self.cfg.saver
        by_steps = sv.freq_steps > 0 and (step + 1) % sv.freq_steps == 0
        by_time = sv.freq_secs > 0 and time.monotonic() - self._last_save >= sv.freq_secs
        return by_steps or by_time

    async def _request_checkpoint(self, step: int) -> None:
        """The trainer saves weights + optimizer with this state before it trains the next step."""
        state = self.core.state() | {"offsets": self.runlog.offsets(), "n_sample_lines": self.runlog.n_sample_lines}
        if self.task_book is not None:
            state["tasks"] = self.task_book.state()
        self._last_save = time.monotonic()
        self._ckpt_pending = step
        for t in self.role("trainer"):
            await self.send(t, CheckpointRequest(step=step, state=state))

    async def _checkpoint_saved(self, wid: str, m: CheckpointSaved) -> None:
        log.info("checkpoint after step %d saved at %s", m.step, m.path)
        self._ckpt_saved = max(self._ckpt_saved, m.step)
        if self._ckpt_pending == m.step:
            self._ckpt_pending = None

    # ---- stopping on a signal: final checkpoint first -----------------------------------
    def request_stop(self) -> None:
        """SIGUSR1 (the supervisor got SIGTERM/SIGINT): no new plans or groups; the trainer saves
        the last finished step (unless saved already); then Shutdown to everyone."""
        if not self.stopping:
            log.info("stop requested: final checkpoint after step %d, then shutdown", self.core.next_step - 1)
            self.stopping = True
            self.tasks.spawn(self._drive(), "scheduler.stop")

    async def _drive_stop(self) -> None:
        if self.core.trainer_busy or self._ckpt_pending is not None or self.done.is_set():
            return  # the step in progress ends first; a requested checkpoint is confirmed first
        last = self.core.next_step - 1
        if last > self._ckpt_saved and self.role("trainer") and self.cfg.mode != "rollout_only":  # nothing learnt
            await self._request_checkpoint(last)
            return
        log.info("stopping: last finished step %d is checkpointed (or none was trained)", last)
        for w in list(self.workers):
            await self.send(w, Shutdown(reason="stopped by signal after the final checkpoint"))
        self.done.set()

    def _metrics_row(self, m: TrainStepDone, trained: list) -> dict:
        now = time.time()
        scores = [r.score for r in trained]
        row = {
            "step": m.step,
            "version": m.version,
            "reward_mean": sum(scores) / max(1, len(scores)),
            "staleness_max": max((m.step - r.version_min for r in trained), default=0),
            "staleness_mean": sum(m.step - r.version_min for r in trained) / max(1, len(trained)),
            "samples_trained": len(trained),
            "samples_trained_total": self.core.ledger.n_trained,
            "samples_generated_total": self.counts["generated"],
            "samples_rewarded_total": self.counts["rewarded"],
            "samples_aborted_total": self.core.ledger.n_aborted,
            "step_s": now - self._step_t,
            "wall_s": now - self.t0,
            # from the previous step's end to this step's plan: waiting for data (t_gen at eta=0)
            "plan_wait_s": max(0.0, self._plan_at.pop(m.step, now) - self._step_t),  # 0: planned ahead
            # rollout engines' cumulative busy seconds, from their last heartbeats
            "gen_busy_s_total": self._busy_s_total("rollout"),
            # reward workers' cumulative seconds with a group being scored, likewise
            "reward_busy_s_total": self._busy_s_total("reward"),
        }
        self._step_t = now
        row.update(metrics_columns(self.weight_updates.last))
        row.update(self._filter_counts())
        if self.task_book is not None:
            row.update(self.task_book.step_row(trained))
        (total, n), (total0, n0) = self.core.scored, self._scored_last
        self._scored_last = list(self.core.scored)
        if n > n0:  # every sample scored since the last row, kept or dropped: what the policy generates now
            row["reward_mean_scored"] = (total - total0) / (n - n0)
        row.update({k: v for k, v in m.metrics.items() if k not in row})
        return row | self._health(row, trained)

    def _health(self, row: dict, trained: list) -> dict:
        """scheduler/health.py's columns: truncation, lengths, group rewards, idle fractions."""
        out = sample_health(trained, row["step"], self.cfg.rollout.max_head_offpolicyness)
        idle = {"trainer_idle_frac": trainer_idle(row, row["step_s"])}
        for (role, meter), busy in zip(self._idle.items(), ("gen_busy_s_total", "reward_busy_s_total")):
            n = sum(1 for w in self.workers.values() if w["role"] == role)
            idle[f"{role}_idle_frac"] = meter.add(row["wall_s"], n, row[busy])
        return out | {k: v for k, v in idle.items() if v is not None}

    def _filter_counts(self) -> dict:
        """rollout.dynamic_filter's drops since the last row and in total (nothing without a filter)."""
        f = self.core.p.group_filter
        if f is None:
            return {}
        now, last = f.counts(), self._filter_last
        self._filter_last = now
        if now["errors"] > last["errors"]:
            log.warning("%d dynamic filter error(s) this step, last: %s", now["errors"] - last["errors"], f.last_error)
        return {
            "dynamic_filter_groups_dropped": now["groups"] - last["groups"],
            "dynamic_filter_samples_dropped": now["samples"] - last["samples"],
            "dynamic_filter_groups_dropped_total": now["groups"],
            "dynamic_filter_errors_total": now["errors"],
        }

    def _busy_s_total(self, role: str) -> float:
        return sum(float(w.get("stats", {}).get("busy_s", 0.0)) for w in self.workers.values() if w["role"] == role)

    # ---- driving the core ----------------------------------------------------------------
    async def _drive(self) -> None:
        if self.stopping:
            return await self._drive_stop()
        starved = self.core.filter_starved()
        if starved and not self.done.is_set():
            return await self._fail(starved)
        for _ in range(2):  # the trainer's next step, then (η >= 1) the one after it, planned ahead
            plan, stale = self.core.plan(ahead=self._may_plan_ahead())
            if stale:
                log.info("aborted %d stale samples (re-issued)", len(stale))
                self.counts["stale"] += len(stale)
            if plan is None:
                break
            await self._send_plan(plan)
        by_worker: dict[str, list[GenerateRequest]] = {}
        for worker, req in self.core.admit():
            self.counts["admitted"] += 1
            by_worker.setdefault(worker, []).append(req)
        for worker, reqs in by_worker.items():  # one message a worker: the groups admitted together
            await self.send(worker, reqs[0] if len(reqs) == 1 else GenerateRequests.of(reqs))

    def _may_plan_ahead(self) -> bool:
        """Plan step n+1 while step n trains (η >= 1, the core checks it) unless a checkpoint
        after step n is pending or due: it must be saved with the books between steps n and n+1,
        before the trainer takes step n+1 off its queue."""
        return self._ckpt_pending is None and not self._save_due(self.core.next_step)

    async def _send_plan(self, plan: BatchPlan) -> None:
        trainers = self.role("trainer")
        if not trainers:
            raise RuntimeError("a batch was planned but no trainer is registered")
        self._plan_at[plan.step] = time.time()
        await self.send(trainers[0], plan)

    async def _finish(self) -> None:
        aborted = self.core.abort_open("run_end: the run reached total_train_steps before this sample was trained")
        c = self.core.ledger.counts()
        summary = {
            "steps": self.core.next_step,
            "version": self.core.version,
            "samples_issued": c["issued"],
            "samples_trained": c["trained"],
            "samples_aborted": c["aborted"],
            "samples_lost": c["issued"] - self.runlog.n_sample_lines,
            "aborted_at_end": len(aborted),
            "prompts_total": self.prompts.n_total,
            "prompts_filtered_long": self.prompts.n_dropped,
            "prompts_reissued": self.core.n_reissued["prompts"],
            "samples_reissued": self.core.n_reissued["samples"],
            "prompts_dropped": self.core.n_reissued["dropped"],
            "recoveries": self.recoveries,
            "wall_s": time.time() - self.t0,
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
        for wid, w in list(self.workers.items()):
            if now - w["last_seen"] > self.cfg.cluster.worker_timeout_s:
                await self._lose(
                    wid,
                    f"no heartbeat for {now - w['last_seen']:.0f}s "
                    f"(cluster.worker_timeout_s={self.cfg.cluster.worker_timeout_s:g})",
                )

    async def _expire_groups(self) -> None:
        expired = self.core.expire()
        if expired:
            reasons = sorted({r.reason for r in expired})
            log.warning("%d samples past their deadline aborted: %s", len(expired), "; ".join(reasons)[:500])
            by_worker: dict[str, list[str]] = {}  # their holders stop the work (a workflow's episodes)
            for r in expired:
                if r.worker in self.workers and r.group_id not in by_worker.get(r.worker, []):
                    by_worker.setdefault(r.worker, []).append(r.group_id)
            for worker, gids in by_worker.items():
                await self.send(worker, AbortGroups(group_ids=gids, reason="deadline"))
            await self._drive()

    async def _lose(self, wid: str, why: str, tell: bool = True) -> None:
        """Forget a worker and re-issue its work. ``tell``: it may still be alive (timed out, not
        restarted): it gets ``Shutdown(lost=True)`` and a line in lost.jsonl, so the supervisor
        kills it if it does not exit; whatever it sends later is refused as unregistered."""
        log.error("worker %s lost: %s", wid, why)
        w = self.workers.pop(wid)
        if tell:
            self._record_lost(wid, w, why)
            try:
                await send_message(self.sock, Shutdown(reason=f"lost: {why}", lost=True), to=w["ident"])
            except zmq.ZMQError:
                pass  # gone already
        if w["role"] == "trainer":
            self.core.trainer_ready = False  # no plan can be sent; the supervisor fails or recovers the run
            log.error("the trainer is lost: no further steps in this fleet")
        lose = {"rollout": self.core.lose_worker, "reward": self.core.lose_reward_worker}.get(w["role"])
        if lose is not None:
            lose(wid, why)
            await self._drive()

    def _record_lost(self, wid: str, w: dict, why: str) -> None:
        line = {"worker": wid, "role": w["role"], "pid": w.get("pid"), "why": why, "wall_s": time.time() - self.t0}
        with open(self.run_dir / "lost.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _write_status(self) -> None:
        """What everyone waits for, for the supervisor's step watchdog (atomic rewrite)."""
        tmp = self._status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._status_doc()))
        os.replace(tmp, self._status_path)

    def _status_doc(self) -> dict:
        """status.json: what the scheduler and each worker wait for, the open work, whose work is overdue."""
        now = time.monotonic()
        workers = {
            wid: {
                "role": w["role"],
                "silent_s": round(now - w["last_seen"], 1),
                "waiting_for": w.get("stats", {}).get("waiting_for", ""),
                "stats": {k: v for k, v in w.get("stats", {}).items() if k in _STATUS_STATS},
            }
            for wid, w in self.workers.items()
        }
        status = {
            "pid": os.getpid(),
            "wall_s": time.time() - self.t0,
            "next_step": self.core.next_step,
            "trainer_ready": self.core.trainer_ready,
            "trainer_busy": self.core.trainer_busy,
            "waiting_for": self.waiting_for(),
            "work": self._open_work(),
            "workers": workers,
        }
        status["overdue"] = overdue(status, self.cfg.cluster.heartbeat_s)
        return status

    def _open_work(self) -> dict:
        """The oldest unfinished work of each kind (``scheduler/overdue.py``); the step in training counts
        from its plan or the previous step's end, whichever is later (a step planned ahead waits for it)."""
        c = self.core
        plan_t = max(self._plan_at.get(c.next_step, self._step_t), self._step_t) if c.trainer_busy else None
        return open_work(c, c.clock(), plan_t)

    def waiting_for(self) -> str:
        """The scheduler's view of what the next trainer step waits for."""
        c, step = self.core, self.core.next_step
        if self.stopping:
            return f"the final checkpoint after step {step - 1}"
        if not c.trainer_ready:
            return (
                "the trainer to register and publish its weights"
                if not self.role("trainer")
                else "the trainer to be ready"
            )
        if c.trainer_busy:
            ago = time.time() - self._plan_at.get(step, self._step_t)
            return f"the trainer to finish step {step} (planned {ago:.0f}s ago)"
        scoring = sum(1 for gid in c.generated_at if getattr(c.ledger.groups.get(gid), "status", "") == "running")
        return (
            f"{len(c.ready)}/{c.p.batch_size} groups ready for step {step}: {c.running - scoring} generating on "
            f"{len(c.rollouts)} rollout worker(s), {scoring} waiting for a score"
        )
