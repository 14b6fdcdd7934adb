"""The trainer process: PPO steps on planned batches, weights published after every step.

::

    start: model (+ optional SFT warm-up) = version 0 ──publish──> rollouts; TrainerReady
    trajectory receiver thread (buffer.py): tensor channel ──> TrajectoryBatch.decode ──> buffer[sample_id] = a row
      forward ahead (eta = 0, ``forward_ahead_samples``): once a step's trajectories are in, this
      thread runs the update's first forward on them (``PPOActor.forward_ahead``) while their
      rewards are scored; the step takes it when its BatchPlan names the same samples
    control loop:
      BatchPlan(step, ids) ─> train(plan), five named stages:
        gather   wait until every planned id is in the buffer; each sample's token versions checked
                 against this trainer's own version and η (``check_fresh``: a stale plan is refused)
        ahead    the forward run ahead (η = 0), kept if it ran on the plan's samples, else dropped
        train    PPOActor.train_step (executor thread: the loop keeps receiving)
        publish  the weights of version step+1, while the scheduler admits and plans when
                 ``EtaMode.publish_overlap`` (the rollouts wait for them by min_version: at η = 0 the
                 step's generate requests are then all queued when the weights land, one decode batch;
                 at η >= 1 the publication overlaps planning and generation); the next message is
                 handled only once they are out. Published first instead when the weight channel is
                 collective (its receivers must be alive to take part), after the run's last step (the
                 scheduler stops the rollouts on its TrainStepDone) and when the evaluator is due
        report   the periodic evaluation when due, then TrainStepDone(step, version=step+1)
      CheckpointRequest     ─> save model, optimizer, scheduler state (checkpoint.py); CheckpointSaved
      HeldQuery (a rollout worker died; answered at once, beside the loop) ─> after a grace for
                              tensors in flight, HeldReply(the ids that never came; refused from now
                              on). The scheduler aborts their groups and sends a BatchPlan revision
                              for any step that named one: the step waits for it and trains it.
      Shutdown              ─> exit (non-zero when the scheduler declared this trainer lost)
    after the run's last step: the policy to RUN_DIR/model (``final_model``, trainer/persist/final_model.py), then
      its TrainStepDone (the scheduler ends the run on it)
    periodic evaluator (optional, evaluator.freq_steps): at version 0 and every due version, after the
      weights are published and before TrainStepDone: evaluate (executor) ─> EvalDone(version, metrics)

What the trainer waits for is in its heartbeat stats (``waiting_for``) for the step watchdog. An
exception in the loop or the heartbeat ends the process non-zero (``TaskSet``).

With K data-parallel ranks (``compute/dp.py``), rank 0 is this service; before each collective phase it
broadcasts a command to ranks 1..K-1 (``FollowerRank``), which have no control plane:

    rank 0                                   ranks 1..K-1 (FollowerRank.loop)
    train:   CMD_TRAIN, batch broadcast  ──> train_step on the same batch (their shares)
    publish: CMD_PUBLISH, gathers bucket by bucket while the channel packs ──> the same gathers
    save:    CMD_SAVE + checkpoint path  ──> DCP save of their shards, export gather
    export:  CMD_EXPORT + directory      ──> the final policy's gather (trainer/persist/final_model.py)
    shutdown: CMD_STOP                   ──> exit 0
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import threading
import time
from typing import Callable, Optional

import torch

from protocols.messages import (
    BatchPlan,
    CheckpointRequest,
    CheckpointSaved,
    EvalDone,
    HeldQuery,
    HeldReply,
    Shutdown,
    TrainerReady,
    TrainStepDone,
    WeightsPublished,
)
from protocols.trajectories import Trajectory

from areal_async.base import cores
from areal_async.base.control import ControlClient
from areal_async.base.eta import EtaMode
from areal_async.trainer.actor import ForwardAhead, PPOActor
from areal_async.trainer.buffer import TrajectoryBuffer
from areal_async.trainer.plan_book import PlanBook
from areal_async.trainer.compute.dp import (
    CMD_EXPORT,
    CMD_NAMES,
    CMD_PUBLISH,
    CMD_SAVE,
    CMD_STOP,
    CMD_TRAIN,
    ShardedWeights,
)
from areal_async.trainer.persist.record import TrainerRecord
from areal_async.trainer.persist.recording import Recorder
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.trainer")


VERSIONS_KEPT = 2  # weight versions held at once (a slow reader may still be on the previous one)
INLINE_PUBLISH_BYTES = 4 << 20  # a state dict up to this size is packed on the loop, not in a thread
# how long a HeldQuery waits for a dead worker's tensors still in flight (the socket's kernel buffers
# deliver what left the process within milliseconds; the receiver thread may be decoding a message)
HELD_GRACE_S = 2.0


SYNCHRONOUS = EtaMode(0)  # the default mode: the strictest staleness bound


class StalePlan(RuntimeError):
    """A plan named a sample this trainer may not train (``check_fresh``): the run stops, nothing is trained."""


def check_fresh(mode: EtaMode, step: int, version: int, got: dict) -> None:
    """Refuse (``StalePlan``, naming the first bad sample) a planned batch holding a trained token older than
    this trainer's own ``version`` allows (``mode.fresh_enough``: version >= step - eta): the trainer checks the
    staleness bound itself from the tensors it received, never trusting the plan for it. ``version`` is the
    trainer's (it trains step v on the weights of version v); ``step`` the plan's. A token stamped newer than
    any published version is a stamping bug, not staleness: ``areal-async verify`` names it (version_unloaded,
    against the rollouts' acknowledged loads; tests/e2e/test_verify_mutants.py injects one)."""
    if step != version:
        raise StalePlan(f"a plan for step {step} reached the trainer at version {version}; expected step == version")
    trained = {sid: trained_versions(v) for sid, v in got.items()}
    views = [t for t in trained.values() if t.numel()]
    if not views or mode.fresh_enough(int(torch.cat(views).min()), version):
        return
    for sid, t in trained.items():
        if t.numel() and not mode.fresh_enough(int(t.min()), version):
            raise StalePlan(
                f"step {step}: planned sample {sid!r} has tokens of versions {int(t.min())}..{int(t.max())}; this "
                f"trainer (version {version}, eta {mode.eta}) trains only versions {version - mode.eta} and newer: "
                "the plan is refused"
            )


def trained_versions(view) -> torch.Tensor:
    """The versions of a sample's trained tokens (loss mask 1). A workflow's environment and tool tokens
    (loss mask 0) carry version -1 and come from no policy (``workflows/base.py``): staleness is judged by
    the model's tokens alone, as the rollout's ``version_min`` and the scheduler judge it."""
    return view.versions if view.loss_mask is None else view.versions[view.loss_mask != 0]


class TrainerService:
    def __init__(
        self,
        control: ControlClient,
        actor: PPOActor,
        traj_channel,
        weight_channel,
        checkpointer=None,
        start_step: int = 0,
        start_version: int = 0,
        plan_timeout_s: float = 300.0,
        publish_dtype: torch.dtype = torch.float32,
        bucket_bytes: int = 64 << 20,
        evaluator=None,
        mode: EtaMode = SYNCHRONOUS,
        total_steps: Optional[int] = None,
        forward_ahead_samples: int = 0,
        record: Optional[TrainerRecord] = None,
        recorder: Optional[Recorder] = None,
        held_grace_s: float = HELD_GRACE_S,
        final_model: Optional[Callable[[], object]] = None,
    ):
        """``mode``: the run's η mode (``base/eta.py``): the staleness bound every planned sample is
        checked against, and ``publish_overlap`` (TrainStepDone before the weights are published,
        except after step ``total_steps - 1``; its ``publish_s`` is then the previous step's
        publication). ``forward_ahead_samples``: the samples of a step at eta = 0; while the
        trainer waits for a BatchPlan, once that many trajectories are in, the update's first
        forward runs on them (``PPOActor.forward_ahead``) as their rewards are scored; the plan's
        step uses it when it names the same samples (0: never). ``record``: the trainer's own record
        of each step (``trainer/persist/record.py``), written before its TrainStepDone; None: none.
        ``final_model``: writes the policy after the last step (``final_model.write_final``, its
        directory returned), before that step's TrainStepDone; None: nothing is kept."""
        if forward_ahead_samples and not actor.can_forward_ahead:
            raise ValueError(
                f"forward_ahead_samples={forward_ahead_samples} but this actor cannot run a forward ahead "
                "(PPOActor.can_forward_ahead); expected 0"
            )
        self.control, self.actor = control, actor
        self.ahead_samples = forward_ahead_samples
        # the forward ahead: its result (ForwardAhead, start, end), set by the thread that runs it; and
        # the task that arms it once the weights' publication is out (see _arm_ahead)
        self._ahead: Optional[concurrent.futures.Future] = None
        self._arming: Optional[asyncio.Task] = None
        self.mode, self.total_steps = mode, total_steps
        self._publishing: Optional[asyncio.Task] = None
        self.publish_s = 0.0
        self.publish_bytes = 0  # the tensors of the last publication (a LoRA run's: the adapter alone)
        self._t_ready: dict[int, float] = {}  # version -> wall time its optimizer step ended
        self.evaluator = evaluator  # app.evaluate.PeriodicEvaluator: due(version), (version, state_dict) -> metrics
        self.record = record
        self.recorder = recorder  # rollout.dump_tensors: each step's batch to RUN_DIR/recording (replay)
        self.buffer = TrajectoryBuffer(traj_channel, on_duplicate=record.duplicate if record is not None else None)
        self.weights = weight_channel
        self.checkpointer = checkpointer
        self.next_step, self.version = start_step, start_version
        self.plan_timeout_s = plan_timeout_s
        self.publish_dtype, self.bucket_bytes = publish_dtype, bucket_bytes
        self._inbox: asyncio.Queue = asyncio.Queue()  # control messages for _loop (HeldQuery: answered beside it)
        self.book = PlanBook()  # the plans held, their revisions, the samples given up on
        self.held_grace_s = held_grace_s  # a HeldQuery's wait for tensors still in flight
        self.final_model = final_model

    async def run(self) -> int:
        self.waiting("registration")
        await self.control.register(info={"next_step": self.next_step})
        self.buffer.thread.start()
        try:
            await self.publish(self.version)
            # the kept versions and the one being written: made while the first step trains (shm)
            self.weights.prewarm(VERSIONS_KEPT + 1)
            await self.control.send(TrainerReady(version=self.version, next_step=self.next_step))
            await self.evaluate()
            tasks, stop = TaskSet(), asyncio.Event()
            tasks.adopt(self.control.heartbeat_task, forever=True)
            tasks.spawn(self._recv_loop(tasks), "trainer.recv", forever=True)
            loop = tasks.spawn(self._loop(), "trainer.loop")
            loop.add_done_callback(lambda _: stop.set())
            await tasks.wait(stop)  # raises if the loop or the heartbeat failed
            tasks.cancel()
            return loop.result()
        finally:
            self.close()

    def waiting(self, what: str) -> None:
        """What the trainer waits for now (heartbeat stats, read by the step watchdog)."""
        self.control.stats["waiting_for"] = what

    def close(self) -> None:
        """Stop the receiver thread before the channels: a collective torn down under a live
        recv aborts the process."""
        self.buffer.stopping.set()
        if self.buffer.thread.is_alive():
            self.buffer.thread.join(timeout=5)
        for ch in (self.buffer.channel, self.weights):
            ch.close()
        self.control.close()  # every socket closed: the context's term() at exit cannot wait on one
        if self.record is not None:
            self.record.close()
        if self.evaluator is not None:
            self.evaluator.close()

    async def _recv_loop(self, tasks: TaskSet) -> None:
        """Control messages, in order, to ``_loop``; a HeldQuery is answered beside it (the loop may
        be waiting for the very samples it asks about), a BatchPlan is also noted as its step's latest."""
        while True:
            msg = await self.control.recv()
            if isinstance(msg, HeldQuery):
                tasks.spawn(self._held(msg), f"trainer.held.{msg.query_id}")
                continue
            if isinstance(msg, BatchPlan) and msg.step >= self.next_step:
                self.book.note(msg)
                self.buffer.wake()  # a take of the plan it replaces gives up (see _take_plan)
            self._inbox.put_nowait(msg)

    async def _held(self, q: HeldQuery) -> None:
        loop = asyncio.get_running_loop()
        missing = await loop.run_in_executor(None, self.buffer.settle, q.sample_ids, self.held_grace_s)
        self.book.given_up.update(missing)
        log.warning(
            "trainer: %d of the %d generated samples of lost worker %s never arrived: given up on",
            len(missing),
            len(q.sample_ids),
            q.worker_id,
        )
        await self.control.send(HeldReply(query_id=q.query_id, missing_ids=missing))

    async def _loop(self) -> int:
        while True:
            self.waiting(f"a BatchPlan for step {self.next_step}")
            self._arm_ahead()
            msg = await self._inbox.get()
            await self._published()  # an overlapped publication ends before anything else touches the model
            if isinstance(msg, BatchPlan) and self.book.superseded(msg, self.next_step):
                continue
            if isinstance(msg, BatchPlan):
                await self.train(msg)
            elif isinstance(msg, CheckpointRequest):
                await self.checkpoint(msg)
            elif isinstance(msg, Shutdown):
                await self._take_ahead(None)  # a forward running ahead ends before the process does
                if msg.lost:
                    log.error("trainer: the scheduler declared this trainer lost (%s); exiting", msg.reason)
                    return 1
                log.info("trainer: shutdown (%s)", msg.reason)
                self.actor.dp.command(CMD_STOP)
                return 0
            else:
                log.debug("trainer: ignoring %s", msg.TYPE)

    def _arm_ahead(self) -> None:
        """Have the update's first forward run on the next ``ahead_samples`` trajectories as soon as they
        are in (unless off or armed): in the receiver thread, right after the message that completes
        them (no hop to this loop and back), or in a thread now if they are in already."""
        if not self.ahead_samples or self._ahead is not None:
            return
        self._ahead = fut = concurrent.futures.Future()
        self._arming = asyncio.ensure_future(self._arm(fut))

    async def _arm(self, fut: concurrent.futures.Future) -> None:
        publishing = self._publishing
        if publishing is not None:  # the channel reads the weights out: no forward before it is done
            await asyncio.wait([publishing])  # (its error is raised in _loop)
        n = self.ahead_samples

        def run() -> None:  # a thread's: the receiver's, or the executor's
            if not fut.set_running_or_notify_cancel():
                return  # disarmed first
            try:
                trajs = [view.scored(math.nan) for _, view in self.buffer.peek(n)]
                if len(trajs) < n:  # a step took some meanwhile (its plan came first): nothing to run ahead on
                    fut.set_result(None)
                    return
                start = time.perf_counter()
                with cores.working():
                    ahead = self.actor.forward_ahead(trajs)
                fut.set_result((ahead, start, time.perf_counter()))
            except BaseException as e:  # raised where the step takes it (_take_ahead)
                fut.set_exception(e)

        if not self.buffer.watch(n, run):
            asyncio.get_running_loop().run_in_executor(None, run)

    async def _take_ahead(self, plan: Optional[BatchPlan]) -> tuple[Optional[ForwardAhead], float]:
        """Stage 2 (ahead): disarm, and (the forward run ahead if it is of ``plan``'s samples, else None; its
        seconds before the plan came). A forward not started is cancelled; one started is waited for (the
        model is in use) and dropped when the plan names other samples or there is no plan."""
        fut, arming, self._ahead, self._arming = self._ahead, self._arming, None, None
        if fut is None:
            return None, 0.0
        arming.cancel()
        self.buffer.watch(0, None)
        if fut.cancel():  # not started (a receiver thread that took the watch meanwhile finds it cancelled)
            return None, 0.0
        came = time.perf_counter()
        try:
            result = await asyncio.wrap_future(fut)
        except Exception:
            if plan is not None:
                raise
            log.exception("trainer: the forward run ahead failed (no step takes it)")
            return None, 0.0
        if plan is None or result is None:
            return None, 0.0
        ahead, start, end = result
        if len(ahead.sample_ids) != len(plan.sample_ids) or set(ahead.sample_ids) != set(plan.sample_ids):
            log.info(
                "trainer: the forward run ahead on %d trajectories is dropped: the plan of step %d names %d "
                "others (%d in common)",
                len(ahead.sample_ids),
                plan.step,
                len(plan.sample_ids),
                len(set(ahead.sample_ids) & set(plan.sample_ids)),
            )
            return None, 0.0
        return ahead, max(0.0, min(end, came) - start)

    async def _published(self) -> None:
        """Wait for the overlapped publication in flight, if any (its error is raised here)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    async def publish(self, version: int) -> None:
        """Send weights of `version` to every rollout worker over the weight channel."""
        loop = asyncio.get_running_loop()
        self.waiting(f"publishing weights v{version}")
        t = time.perf_counter()
        if self.actor.dp.active:  # the other ranks gather with us (one rank: nothing to tell)
            await loop.run_in_executor(None, self.actor.dp.command, CMD_PUBLISH, version)
        sd = self.actor.publish_state(self.publish_dtype, self.bucket_bytes)
        # a small state packs in less time than two thread hops take (330 KB: ~0.4 ms vs ~1.5 ms of wall
        # at eta = 1 on 2 cores); a large one in a thread, so the loop (heartbeats) runs meanwhile
        self.publish_bytes = sum(t.numel() * t.element_size() for _, t in sd.items())  # meta tensors when sharded
        inline = isinstance(sd, dict) and self.publish_bytes <= INLINE_PUBLISH_BYTES
        if inline:
            manifest = self.weights.publish_begin(version, sd)
        else:
            manifest = await loop.run_in_executor(None, self.weights.publish_begin, version, sd)
        t_ready = self._t_ready.pop(version, 0.0)
        msg = WeightsPublished(version=version, manifest=manifest, t_ready=t_ready, t_sent=time.time())
        await self.control.send(msg)
        if inline and not self.weights.publish_end_waits:
            self.weights.publish_end()
        else:
            await loop.run_in_executor(None, self.weights.publish_end)
        if isinstance(sd, ShardedWeights):
            await loop.run_in_executor(None, sd.finish)  # the buckets the channel skipped: every rank gathers all
        self.publish_s = time.perf_counter() - t
        if version >= VERSIONS_KEPT:
            self.weights.release(version - VERSIONS_KEPT)

    async def train(self, plan: BatchPlan) -> None:
        """One step, as named stages: gather -> ahead -> train -> publish -> report (docs/loop.md)."""
        if plan.step != self.next_step:
            raise RuntimeError(f"BatchPlan for step {plan.step}, but the trainer is at step {self.next_step}")
        t = {"start": time.perf_counter()}
        plan, got = await self._gather(plan)
        t["gathered"] = time.perf_counter()
        ahead, ahead_s = await self._take_ahead(plan)  # waiting for its forward's end: training time
        trajs = self._batch(plan, got, ahead)
        t["ahead"] = time.perf_counter()
        self.waiting(f"its own train_step (step {plan.step})")
        metrics = await asyncio.get_running_loop().run_in_executor(None, self._train_ranks, plan.step, trajs, ahead)
        t["trained"] = time.perf_counter()
        await self._publish_step()
        metrics.update(
            wait_data_s=t["gathered"] - t["start"],
            train_s=t["trained"] - t["gathered"],
            ahead_s=ahead_s,
            publish_s=self.publish_s,
            publish_bytes=float(self.publish_bytes),
        )
        await self._report(plan, trajs, metrics)

    async def _gather(self, plan: BatchPlan) -> tuple[BatchPlan, dict]:
        """Stage 1: the tensors of the step's latest plan, each sample checked against this trainer's own
        version and the staleness bound (``check_fresh``: refused, not trusted)."""
        plan, got = await self._take_plan(self.book.latest(plan))
        check_fresh(self.mode, plan.step, self.version, got)
        return plan, got

    def _batch(self, plan: BatchPlan, got: dict, ahead: Optional[ForwardAhead]) -> list[Trajectory]:
        """Stage 2's result: the step's trajectories, in the order its forward ran ahead when one did."""
        if ahead is None:
            return [got[sid].scored(score) for sid, score in zip(plan.sample_ids, plan.scores)]
        score = dict(zip(plan.sample_ids, plan.scores))
        return [got[sid].scored(score[sid]) for sid in ahead.sample_ids]

    async def _publish_step(self) -> None:
        """Stage 4: the new version out to the rollouts; overlapped with what follows (``EtaMode.publish_overlap``)
        except after the run's last step and when the evaluator is due, which read the published weights."""
        self._t_ready = {self.next_step + 1: time.time()}  # the update's clock starts at the optimizer step's end
        self.next_step = self.version = self.next_step + 1
        last = self.total_steps is not None and self.next_step >= self.total_steps
        due = self.evaluator is not None and self.evaluator.due(self.version)
        if self.mode.publish_overlap and not last and not due:  # the rollouts wait for it by min_version
            self._publishing = asyncio.ensure_future(self.publish(self.version))
        else:
            await self.publish(self.version)

    async def _report(self, plan: BatchPlan, trajs: list[Trajectory], metrics: dict) -> None:
        """Stage 5: the evaluation when due (before TrainStepDone: after the last step the scheduler ends the
        run), the final policy after the last step, then TrainStepDone with the step's metrics and the samples
        whose optimizer step was skipped."""
        await self.evaluate()
        if self.total_steps is not None and self.next_step >= self.total_steps and self.final_model is not None:
            self.waiting("writing the final policy")
            t = time.perf_counter()
            path = await asyncio.get_running_loop().run_in_executor(None, self.final_model)
            metrics["final_model_s"] = time.perf_counter() - t
            log.info("the final policy (version %d) written to %s", self.version, path)
        skipped = [trajs[i].sample_id for i in sorted(self.actor.skipped_indices)]
        done = {k: float(v) for k, v in metrics.items()}
        await self.control.send(TrainStepDone(step=plan.step, version=self.version, metrics=done, skipped_ids=skipped))

    async def _take_plan(self, plan: BatchPlan) -> tuple[BatchPlan, dict]:
        """The tensors of the step's latest plan, out of the buffer: a plan naming a sample given up on
        waits for its revision; a revision that comes while the tensors are awaited replaces it."""
        loop, step = asyncio.get_running_loop(), plan.step
        while True:
            plan = self.book.latest(plan)
            self.buffer.drop(plan.aborted_ids)
            if self.book.names_given_up(plan):
                self.waiting(f"a revised BatchPlan for step {step} (planned samples of a lost worker never came)")
                plan = await self.book.revision_of(plan, self.plan_timeout_s)
                continue
            self.waiting(f"trajectory tensors of the {len(plan.sample_ids)} samples planned for step {step}")
            got = self.buffer.take_ready(plan.sample_ids)  # at eta >= 1 they are usually all in: no thread hop
            if got is None:
                revised = functools.partial(self.book.replaced, plan)
                got = await loop.run_in_executor(None, self.buffer.take, plan.sample_ids, self.plan_timeout_s, revised)
            if got is not None:
                self.book.trained(step)
                return plan, got

    def _train_ranks(
        self, step: int, trajs: list[Trajectory], ahead: Optional[ForwardAhead] = None
    ) -> dict[str, float]:
        """Every rank trains on this batch: the others get the command and the batch first (``ahead``:
        its forward run ahead, one rank only). ``train_cpu_s``: this thread's CPU time for it (train_s
        less it: waiting for a core or the GIL)."""
        c0 = time.thread_time()
        self.actor.dp.command(CMD_TRAIN, step)
        rng = self.recorder.rng_state() if self.recorder is not None else None
        with cores.working():  # cluster.share_cores: busy, the threads paced per layer (base/cores.py)
            metrics = self.actor.train_step(self.actor.dp.broadcast_batch(trajs), ahead=ahead)
        if self.recorder is not None:  # the batch as trained, in its order; replay runs it again
            t = time.perf_counter()
            metrics["record_bytes"] = self.recorder.step(step, step + 1, trajs, rng)
            metrics["record_s"] = time.perf_counter() - t
        if self.record is not None:  # before TrainStepDone: a step the scheduler books is in the record
            steps = (int(metrics["optimizer_steps"]), int(metrics["skipped_steps"]))
            self.record.step(step, step + 1, trajs, self.actor.skipped_indices, steps)
        metrics["train_cpu_s"] = time.thread_time() - c0
        return metrics

    async def evaluate(self) -> None:
        """Run the periodic evaluator on the current weights when it is due; its row goes to the scheduler."""
        if self.evaluator is None or not self.evaluator.due(self.version):
            return
        sd = self.actor.full_state()
        metrics = await asyncio.get_running_loop().run_in_executor(None, self.evaluator, self.version, sd)
        log.info("evaluation of version %d: %s", self.version, metrics)
        await self.control.send(EvalDone(version=self.version, metrics=metrics))

    async def checkpoint(self, req: CheckpointRequest) -> None:
        if self.checkpointer is None:
            log.warning("checkpoint requested but saving is not configured")
            return
        self.waiting(f"saving the checkpoint after step {req.step}")
        loop = asyncio.get_running_loop()
        await self._take_ahead(None)  # not while a forward runs ahead on the model (re-armed after)
        path = await loop.run_in_executor(None, self.checkpointer, req.step, self.version, req.state)
        log.info("checkpoint after step %d saved to %s", req.step, path)
        await self.control.send(CheckpointSaved(step=req.step, path=str(path)))


class FollowerRank:
    """Trainer ranks 1..K-1: no sockets; each runs the collective phases rank 0 commands."""

    def __init__(self, actor: PPOActor, save_shards, publish_dtype: torch.dtype, bucket_bytes: int, export=None):
        """``export(directory)``: this rank's part of writing the final policy (``final_model.exporter``)."""
        self.actor, self.save_shards, self.export = actor, save_shards, export
        self.publish_dtype, self.bucket_bytes = publish_dtype, bucket_bytes

    async def run(self) -> int:
        """``loop`` in a daemon thread: a SIGTERM (task cancelled) must not wait for a collective."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def body() -> None:
            try:
                code = self.loop()
                loop.call_soon_threadsafe(done.set_result, code)
            except BaseException as e:  # handed to the event loop, which re-raises it in run()
                loop.call_soon_threadsafe(done.set_exception, e)

        threading.Thread(target=body, name=f"rank-{self.actor.dp.rank}", daemon=True).start()
        return await done

    def loop(self) -> int:
        dp = self.actor.dp
        while True:
            op, arg, text = dp.command()
            log.debug("rank %d: %s %d", dp.rank, CMD_NAMES.get(op, op), arg)
            if op == CMD_TRAIN:
                with cores.working():
                    self.actor.train_step(dp.broadcast_batch(None))
            elif op == CMD_PUBLISH:
                self.actor.publish_state(self.publish_dtype, self.bucket_bytes).gather_all()
            elif op == CMD_SAVE:
                self.save_shards(text)
            elif op == CMD_EXPORT and self.export is not None:
                self.export(text)
            elif op == CMD_STOP:
                log.info("rank %d: stop", dp.rank)
                return 0
            else:
                raise RuntimeError(
                    f"rank {dp.rank}: unknown command {op} from trainer rank 0; expected one of {sorted(CMD_NAMES)}"
                )
