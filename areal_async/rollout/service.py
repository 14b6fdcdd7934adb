"""The rollout worker process: one generation engine behind the control plane.

Two threads of control::

    asyncio loop (main thread)                      engine thread
    ───────────────────────────                     ─────────────────────────────────────
    GenerateRequest(s) > inbox ──────────────────>  waits until its weights >= min_version,
    WeightsPublished ─> fetch tensors (executor)    then add_request
                      ─> pending weights (newest) >  between two steps: update_weights
                                                     (interrupt; KV recomputed; resume)
    <── finished groups ────────────────────────── step() ... group done
    per engine step: RewardRequest Batch (its groups, one a reward worker) -> reward workers (PUSH),
                tensors -> trainer (tensor channel), one TrajectoryReady Batch -> scheduler
    <── WeightsLoaded(version) ─────────────────── after each weight switch
    AbortGroups > engine.abort ───────────────────> between two steps: abort_groups (stragglers, deadlines)
    <── GroupsStopped(tokens) ──────────────────── the tokens they had generated (wasted)

``rollout.on_weights=finish``: a pending update waits until nothing is in flight; meanwhile the engine
starts no new sequence (``hold_new``) and the running ones end under the old weights (``drain_s``).

The engine thread is the only one that touches the engine, so generation and weight updates
never race; the event loop stays free to receive while a step runs. Trajectory tensors are sent
from one sender thread (a gloo/NCCL send blocks until the trainer receives it): the loop, and
with it the heartbeat, never waits on a peer. An exception in any loop ends the process
non-zero (``TaskSet``); ``Shutdown(lost=True)`` from the scheduler does too. An engine that raises
``Unfixable`` (every server refuses the trainer's weights) ends it with that error, which the supervisor
does not restart.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import zmq
import zmq.asyncio

from protocols.messages import (
    AbortGroups,
    Batch,
    Error,
    GenerateRequest,
    RewardRequest,
    RewardResult,
    GroupAborted,
    GroupsStopped,
    Shutdown,
    TrajectoryReady,
    WeightsLoaded,
    WeightsPublished,
    batched,
)
from protocols.sockets import make_socket, send_message
from protocols.trajectories import TrajectoryBatch

from areal_async.base.process import Unfixable
from areal_async.rollout.engines.engine import GenRequest, RolloutEngine
from areal_async.rollout.episodes import EpisodeFailed, Episodes, ScoreFn, SubRequest, WorkerEngine
from areal_async.rollout.record import RolloutRecord
from areal_async.base.records import RewardRecord
from areal_async.workflows.base import Episode
from areal_async.base import cores
from areal_async.base.control import ControlClient
from areal_async.base.aio import TaskSet

log = logging.getLogger("areal_async.rollout")

MESSAGE_BYTES = 16 << 20  # payload of one trajectory message carrying several groups (RolloutService)


def message_bytes(max_message_mb: float) -> int:
    """Payload bound of a message of several groups: ``MESSAGE_BYTES`` within half the trainer's
    bound on one message (``tensor_channel.max_message_mb``; the other half: room for the header)."""
    return min(MESSAGE_BYTES, int(max_message_mb * 2**20) // 2)


@dataclass
class _Pending:
    version: int
    state_dict: dict
    times: dict  # WeightsLoaded.times so far: 'manifest', 'received'


class EngineThread(threading.Thread):
    """Drives the engine: admits requests, steps, applies weights between steps."""

    def __init__(
        self,
        engine: RolloutEngine,
        on_groups: Callable[[list, dict], None],
        on_loaded: Callable[[int, dict], None],
        max_active_groups: int,
        on_stopped: Callable[[dict], None] = lambda counts: None,
    ):
        super().__init__(name="engine", daemon=True)
        self.engine, self.on_groups, self.on_loaded, self.on_stopped = engine, on_groups, on_loaded, on_stopped
        self.inbox: "queue.Queue[GenerateRequest]" = queue.Queue()
        self.aborts: "queue.Queue[list[str]]" = queue.Queue()
        self.drain_t0: Optional[float] = None  # on_weights=finish: when the running sequences began to drain
        self.waiting: list[GenerateRequest] = []
        self.requests: dict[str, GenerateRequest] = {}
        self.max_active = max_active_groups
        self._weights: Optional[_Pending] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.stopping = threading.Event()
        self.failure: Optional[BaseException] = None  # what ended the thread, if anything did
        self.busy_s = 0.0
        self.step_t0: Optional[float] = None  # monotonic start of the engine step running now
        self.stepped = False  # an engine step has ended (the first tokens were generated)

    def submit(self, req: GenerateRequest) -> None:
        self.inbox.put(req)
        self._wake.set()

    def abort(self, group_ids: list[str]) -> None:
        """Drop these groups at the next step boundary (queued or generating)."""
        self.aborts.put(list(group_ids))
        self._wake.set()

    def offer_weights(self, version: int, state_dict: dict, times: Optional[dict] = None) -> None:
        with self._lock:  # newest wins: an older pending update is dropped unseen
            if self._weights is None or version > self._weights.version:
                self._weights = _Pending(version, state_dict, dict(times or {}))
        self._wake.set()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._apply_aborts()
                self._apply_weights()
                self._admit()
                if self.engine.has_work():
                    cores.mark(True)  # cluster.share_cores: busy, this step's threads (base/cores.py)
                    t = self.step_t0 = time.perf_counter()
                    done = self.engine.step()
                    self.step_t0 = None
                    self.busy_s += time.perf_counter() - t
                    if not self.stepped:  # the start-up's end, as benchmarks/startup.py reads it from the log
                        self.stepped = True
                        log.info("first tokens generated (weights v%d)", self.engine.version)
                    if done:
                        self.on_groups(done, self.requests)
                else:
                    cores.mark(False)  # waiting: its CPUs go to whoever computes
                    self._wake.wait(0.05)
                    self._wake.clear()
        except Exception as e:  # the worker must die loudly, not hang with a dead engine thread
            log.exception("engine thread failed")
            self.failure = e
            self.on_groups(None, {})
        finally:
            cores.mark(False)  # stopped mid-step (shutdown): its CPUs are not held past it

    def _apply_aborts(self) -> None:
        """The groups the scheduler aborted leave the waiting list and the engine; their tokens are reported."""
        gids: set[str] = set()
        while not self.aborts.empty():
            gids.update(self.aborts.get_nowait())
        if not gids:
            return
        self._take_inbox()
        self.waiting = [r for r in self.waiting if r.group_id not in gids]
        stopped = self.engine.abort_groups(sorted(gids & set(self.requests)))
        for gid in stopped:
            self.requests.pop(gid, None)
        if stopped:
            self.on_stopped(stopped)

    def _drain(self, version: int) -> bool:
        """on_weights=finish: True while sequences started under the old weights still run (nothing new starts)."""
        if self.engine.on_weights != "finish" or version <= self.engine.version or not self.engine.in_flight():
            return False
        if self.drain_t0 is None:
            self.drain_t0 = time.time()
            self.engine.hold_new(True)
        return True

    def _apply_weights(self) -> None:
        with self._lock:
            if self._weights is not None and self._drain(self._weights.version):
                return
            pending, self._weights = self._weights, None
        if pending is not None and pending.version > self.engine.version:
            times = pending.times
            times["load_start"] = time.time()
            if self.drain_t0 is not None:
                times["drain_s"] = times["load_start"] - max(self.drain_t0, times.get("received", self.drain_t0))
                self.drain_t0 = None
                self.engine.hold_new(False)
            cores.mark(True)  # the load and its KV recompute compute too
            self.engine.update_weights(pending.version, pending.state_dict)
            times["loaded"] = time.time()
            times.update(getattr(self.engine, "update_split", None) or {})  # load_s / recompute_s, if it says
            self.on_loaded(pending.version, times)

    def _take_inbox(self) -> None:
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break

    def _admit(self) -> None:
        self._take_inbox()
        keep = []
        for req in self.waiting:
            if isinstance(req, SubRequest) and req.future.done():
                continue  # its episode was cancelled (group aborted, timed out): never started
            if req.min_version <= self.engine.version and len(self.requests) < self.max_active:
                self.requests[req.group_id] = req
                self.engine.add_request(req.gen if isinstance(req, SubRequest) else _gen_request(req))
            else:
                keep.append(req)
        self.waiting = keep


def _gen_request(r: GenerateRequest) -> GenRequest:
    return GenRequest(
        group_id=r.group_id,
        prompt_ids=list(r.prompt_ids),
        n=len(r.sample_ids),
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        greedy=r.greedy,
        stop_token_ids=tuple(r.stop_token_ids),
        sample_ids=tuple(r.sample_ids),
    )


class RolloutService:
    def __init__(
        self,
        worker_id: str,
        control: ControlClient,
        ctx: zmq.asyncio.Context,
        engine: RolloutEngine,
        decode: Callable[[list[list[int]]], list[str]],
        traj_channel,
        weight_channel,
        reward_endpoints: list[str],
        max_active_groups: int,
        episodes: Optional[Episodes] = None,
        tokenizer=None,
        score: Optional[ScoreFn] = None,
        message_bytes: int = MESSAGE_BYTES,
        record: Optional[RolloutRecord] = None,
        reward_record: Optional[RewardRecord] = None,
        question: Optional[Callable[[list[int]], str]] = None,
    ):
        """``decode``: completions' token ids -> their texts, many at once (``models.tokenizer.batch_decoder``).
        ``episodes`` (a workflow's, with the ``tokenizer`` and the ``score`` coroutine it needs; its
        error window ends the run when it fails too often): run its episodes instead of plain sampling;
        their rewards go to the scheduler from here.
        ``message_bytes``: groups finished in one engine step share a trajectory message up to this
        many payload bytes (a larger group travels alone). ``record``: this worker's own record of
        the groups it produced and the versions it loaded (``rollout/record.py``), each group written before
        its tensors go out; ``reward_record``: the scores a workflow gave its episodes (``base/records.py``),
        written before they go to the scheduler. ``question``: prompt ids -> the dataset's prompt text, for a
        reward that reads the question (``reward.judge``): it goes with every reward request and check."""
        self.worker_id, self.control, self.decode = worker_id, control, decode
        self.traj, self.weights = traj_channel, weight_channel
        self.reward_sock = make_socket(ctx, zmq.PUSH, connect=reward_endpoints)
        self.n_reward_peers = max(1, len(reward_endpoints))  # a step's groups go out in this many messages
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.engine = EngineThread(
            engine, self._groups_from_thread, self._loaded_from_thread, max_active_groups, self._stopped_from_thread
        )
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.stop = asyncio.Event()
        self.error: Optional[str] = None
        self.n_samples = 0
        self.episodes, self.tokenizer, self.score = episodes, tokenizer, score
        self._reported = False  # the error window's verdict went to the scheduler
        self.tasks: Optional[TaskSet] = None
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="traj-send")  # one thread: sends in order
        self.message_bytes = message_bytes
        self.record, self.reward_record = record, reward_record
        self.question = question

    # ---- thread -> loop ------------------------------------------------------------------
    def _groups_from_thread(self, groups: Optional[list], requests: dict) -> None:
        items = None if groups is None else [(g, requests.pop(g.group_id)) for g in groups]
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, ("groups", items))

    def _loaded_from_thread(self, version: int, times: dict) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, ("loaded", (version, times)))

    def _stopped_from_thread(self, counts: dict) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, ("stopped", counts))

    # ---- main ----------------------------------------------------------------------------
    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        await self.control.register(info={"max_active_groups": self.engine.max_active})
        self.engine.start()
        self.tasks = TaskSet()
        self.tasks.adopt(self.control.heartbeat_task, forever=True)
        self.tasks.spawn(self._recv_loop(), "rollout.recv", forever=True)
        self.tasks.spawn(self._out_loop(), "rollout.out", forever=True)
        self.control.live_stats = self._live_stats
        try:
            await self.tasks.wait(self.stop)  # raises if a loop failed
        finally:
            self.tasks.cancel()
            await self._close_episodes()
            self.engine.stopping.set()
            self.engine.join(timeout=10)
            if hasattr(self.engine.engine, "close"):  # a remote engine: stop its request threads
                self.engine.engine.close()
            self._sender.shutdown(wait=False, cancel_futures=True)
            for ch in (self.traj, self.weights):
                ch.close()
            self.reward_sock.close(0)
            self.control.close()  # every socket closed: the context's term() at exit cannot wait on one
            for rec in (self.record, self.reward_record):
                if rec is not None:
                    rec.close()
        if isinstance(self.engine.failure, Unfixable):  # e.g. every server refuses the weights: no restart
            raise self.engine.failure
        if self.error:
            log.error("%s: exiting non-zero: %s", self.worker_id, self.error)
        return 1 if self.error else 0

    async def _close_episodes(self) -> None:
        """Run end (or failure): every workflow episode still running is cancelled; the log says how many
        outlived the cancellation (0: nothing leaked)."""
        if self.episodes is None:
            return
        n = len(self.episodes.started) + len(self.episodes.groups)
        leaked = await self.episodes.close()
        log.info("%s: at exit %d workflow task(s) cancelled, %d still live (leaked)", self.worker_id, n, leaked)

    def _live_stats(self) -> dict:
        """Ages as of each heartbeat: the engine step running now (0: none), the workflow's episodes."""
        t0 = self.engine.step_t0
        out = {"engine_step_s": 0.0 if t0 is None else round(time.perf_counter() - t0, 1)}
        return out | (self.episodes.stats() if self.episodes is not None else {})

    def _note_waiting(self) -> None:
        """What this worker waits for (heartbeat stats, read by the step watchdog)."""
        e = self.engine
        queued = len(e.waiting) + e.inbox.qsize()
        self.control.stats["waiting_for"] = (
            f"generating {len(e.requests)} group(s), {queued} queued "
            f"(weights v{self.control.stats.get('version', -1)} loaded)"
        )

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.control.recv()
            if isinstance(msg, GenerateRequest):
                self._take_requests([msg])
            elif isinstance(msg, Batch) and msg.item_type is GenerateRequest:  # the groups admitted together
                self._take_requests(msg.items())
            elif isinstance(msg, AbortGroups):
                self._abort_groups(msg)
            elif isinstance(msg, WeightsPublished):
                self.tasks.spawn(self._fetch_weights(msg), f"rollout.fetch_weights.v{msg.version}")
            elif isinstance(msg, Shutdown) and msg.lost:
                self.error = f"the scheduler declared this worker lost ({msg.reason})"
                self.stop.set()
            elif isinstance(msg, Shutdown):
                log.info("%s: shutdown (%s)", self.worker_id, msg.reason)
                self.stop.set()
            else:
                log.debug("%s: ignoring %s", self.worker_id, msg.TYPE)
            self._note_waiting()

    def _abort_groups(self, m: AbortGroups) -> None:
        """The scheduler aborted these groups (past a deadline, stragglers): their workflow episodes are
        cancelled, or the engine drops them (a trajectory that was already on its way is refused)."""
        if self.episodes is None:
            self.engine.abort(m.group_ids)
        n = self.episodes.cancel(m.group_ids) if self.episodes is not None else 0
        log.warning("%s: %d group(s) aborted (%s); %d cancelled here", self.worker_id, len(m.group_ids), m.reason, n)

    def _take_requests(self, reqs: list[GenerateRequest]) -> None:
        for req in reqs:
            if self.episodes is not None:  # a group that fails is aborted; an error here ends the worker
                self.tasks.adopt(self.episodes.start(req.group_id, self._run_workflow(req)))
            else:
                self.engine.submit(req)

    async def _fetch_weights(self, m: WeightsPublished) -> None:
        times = {"manifest": time.time()}
        try:
            sd = await asyncio.get_running_loop().run_in_executor(None, self.weights.receive, m.manifest)
        except Exception as e:  # a bad or vanished payload must not kill generation
            log.error("%s: weights v%d not loaded: %s", self.worker_id, m.version, e)
            return
        times["received"] = time.time()
        self.engine.offer_weights(m.version, sd, times)

    async def _out_loop(self) -> None:
        while True:
            kind, payload = await self.outbox.get()
            if kind == "stopped":
                gids = sorted(payload)
                n = [int(payload[g]) for g in gids]
                await self.control.send(GroupsStopped(worker_id=self.worker_id, group_ids=gids, n_output_tokens=n))
            elif kind == "loaded":
                version, times = payload
                if self.record is not None:  # the engine's acknowledgement, as it leaves
                    self.record.loaded(version)
                await self.control.send(WeightsLoaded(worker_id=self.worker_id, version=version, times=times))
                self.control.stats["version"] = version
            elif payload is None:
                self.error = "engine thread failed"
                self.stop.set()
            else:
                for group, req in payload:
                    if isinstance(req, SubRequest) and not req.future.done():
                        req.future.set_result(group.samples()[0])
                await self._publish_groups([(g, r) for g, r in payload if not isinstance(r, SubRequest)])
            self._note_waiting()

    async def _publish_groups(self, items: list[tuple[TrajectoryBatch, GenerateRequest]]) -> None:
        """The groups one engine step finished: every group's tensors go out from the sender thread
        (one hop for all) while this loop decodes the texts and sends their reward requests, in one
        Batch of RewardRequest a reward worker (``reward_batches``); once both are out, one
        Batch of TrajectoryReady for them all (the scheduler takes a group's score and trajectory in either
        order; the tensors precede it). At eta = 0 the trainer runs the step's first forward on the
        tensors while the rewards are scored (``actor.forward_ahead``): the tensors go first, at every eta
        (the η mode, ``base/eta.py``: nothing waits on the order at eta >= 1)."""
        if not items:
            return
        groups = [self._trajectory(group, req) for group, req in items]
        if self.record is not None:  # before the tensors: whatever the trainer gets was recorded produced
            self.record.groups(groups, outputs=[g.output_ids.split(g.lengths) for g, _ in items])
        # built and sent from the sender thread: a gloo/NCCL send blocks until the trainer takes it, and
        # the loop (heartbeats) must not
        sent = asyncio.get_running_loop().run_in_executor(self._sender, self._send_all, items)
        texts = iter(self.decode([ids for g, _ in items for ids in _split_list(g.output_ids, g.lengths)]))
        requests = [
            RewardRequest(
                group_id=req.group_id,
                sample_ids=list(group.sample_ids),
                completions=[next(texts) for _ in range(group.n_samples)],
                solutions=req.solutions,
                prompt=self.question(req.prompt_ids) if self.question is not None else "",
            )
            for group, req in items
        ]
        for batch in reward_batches(requests, self.n_reward_peers):
            await send_message(self.reward_sock, batch)
        await sent  # before TrajectoryReady: the trainer may be asked for the group next
        await self._trajectories_ready(groups)

    def _send_all(self, items: list[tuple[TrajectoryBatch, GenerateRequest]]) -> None:
        """The groups' tensors as few messages as ``message_bytes`` allows (``trajectory_messages``)."""
        for batch in trajectory_messages([g for g, _ in items], self.message_bytes):
            self.traj.send(*batch.encode())

    async def _trajectories_ready(self, groups: list[TrajectoryReady]) -> None:
        """The groups of one engine step in one Batch (a lone group: its TrajectoryReady alone)."""
        await self.control.send(batched(groups))
        self.n_samples += sum(len(g.sample_ids) for g in groups)
        self.control.stats.update(samples=self.n_samples, busy_s=round(self.engine.busy_s, 3))

    def _trajectory(self, group: TrajectoryBatch, req: GenerateRequest) -> TrajectoryReady:
        versions = _split_list(group.versions, group.lengths)  # one call a group, not reductions a sample
        return TrajectoryReady(
            group_id=req.group_id,
            worker_id=self.worker_id,
            n_prompt_tokens=len(req.prompt_ids),
            sample_ids=list(group.sample_ids),
            n_output_tokens=list(group.lengths),
            version_min=[min(v) if v else -1 for v in versions],
            version_max=[max(v) if v else -1 for v in versions],
            finish_reasons=list(group.finish_reasons),
        )

    # ---- workflow episodes ---------------------------------------------------------------
    async def _run_workflow(self, req: GenerateRequest) -> None:
        score = self.score
        if self.question is not None and score is not None:  # the judge reads the episode's question
            score = functools.partial(score, prompt=self.question(req.prompt_ids))
        handle = WorkerEngine(self.engine.submit, self.tokenizer, score, req.group_id, req.min_version)
        try:
            episodes = await self.episodes.run_group(handle, req)
        except EpisodeFailed as e:  # this group is aborted (and re-issued); the worker goes on
            trace = "\n" + e.trace if e.trace else ""
            log.error("%s: group %s aborted: %s%s", self.worker_id, req.group_id, e.reason, trace)
            await self.control.send(GroupAborted(group_id=req.group_id, worker_id=self.worker_id, reason=e.reason))
            return await self._judge_workflow()
        await self._publish_episodes(req, episodes)
        await self._judge_workflow()

    async def _judge_workflow(self) -> None:
        """Failing too often (``ErrorWindow``): the scheduler ends the run with the verdict (sent once)."""
        verdict = self.episodes.errors.verdict()
        if verdict and not self._reported:
            self._reported = True
            log.error("%s: %s", self.worker_id, verdict)
            await self.control.send(Error(code="workflow_failed", detail=verdict, worker_id=self.worker_id))

    async def _publish_episodes(self, req: GenerateRequest, episodes: list[Episode]) -> None:
        """Tensors (with the loss mask) to the trainer, then TrajectoryReady and the episodes' rewards."""
        sids = list(req.sample_ids)
        trained = [ep.model_versions for ep in episodes]
        ready = TrajectoryReady(
            group_id=req.group_id,
            worker_id=self.worker_id,
            n_prompt_tokens=len(episodes[0].prompt_ids),  # the request's, or an agent group's shared prompt
            sample_ids=sids,
            n_output_tokens=[len(ep.output_ids) for ep in episodes],
            version_min=[min(v) for v in trained],
            version_max=[max(v) for v in trained],
            finish_reasons=[ep.finish_reason for ep in episodes],
            turns=[ep.turns for ep in episodes],
        )
        if self.record is not None:
            self.record.groups(
                [ready], n_loss=[[len(v) for v in trained]], outputs=[[ep.output_ids for ep in episodes]]
            )
        self.traj.send(*episode_batch(req.group_id, sids, episodes).encode())
        await self.control.send(ready)
        scores = [ep.reward for ep in episodes]
        if self.reward_record is not None:  # what the workflow scored, before it leaves
            self.reward_record.groups([(req.group_id, sids, scores, ["ok"] * len(sids))])
        await self.control.send(
            RewardResult(
                group_id=req.group_id,
                worker_id=self.worker_id,
                sample_ids=sids,
                scores=scores,
                statuses=["ok"] * len(sids),
                details=[f"workflow: {ep.turns} turn(s)" for ep in episodes],
            )
        )
        self.n_samples += len(sids)
        self.control.stats.update(samples=self.n_samples, busy_s=round(self.engine.busy_s, 3))


def trajectory_messages(batches: list[TrajectoryBatch], max_bytes: int) -> list[TrajectoryBatch]:
    """``batches`` (one group each, in order) as few messages as ``max_bytes`` allows: consecutive
    groups share one message while its payload stays within ``max_bytes`` (a group over it travels alone)."""
    out, chunk, size = [], [], 0
    for b in batches:
        n = b.nbytes
        if chunk and size + n > max_bytes:
            out.append(TrajectoryBatch.join(chunk))
            chunk, size = [], 0
        chunk.append(b)
        size += n
    if chunk:
        out.append(TrajectoryBatch.join(chunk))
    return out


def reward_batches(requests: list[RewardRequest], n_peers: int) -> list[Batch]:
    """The groups to score as ``min(n_peers, len(requests))`` messages of consecutive groups, sizes
    differing by at most one: one message a reward worker (PUSH deals them round-robin), not one a group."""
    k = min(n_peers, len(requests))
    bounds = [len(requests) * i // k for i in range(k + 1)]
    return [Batch.of(requests[a:b]) for a, b in zip(bounds, bounds[1:])]


def _split_list(x: torch.Tensor, lengths: list[int]) -> list[list]:
    """``x`` (1D) as one Python list per consecutive ``lengths`` slice (one ``tolist`` in all)."""
    flat, out, at = x.tolist(), [], 0
    for n in lengths:
        out.append(flat[at : at + n])
        at += n
    return out


def episode_batch(group_id: str, sample_ids: list[str], episodes: list[Episode]) -> TrajectoryBatch:
    """A group's workflow episodes as one trajectory batch, with their loss mask."""
    cat = lambda name: [x for ep in episodes for x in getattr(ep, name)]  # noqa: E731
    return TrajectoryBatch.group(
        group_id,
        sample_ids,
        episodes[0].prompt_ids,
        [len(ep.output_ids) for ep in episodes],
        *(cat(name) for name in ("output_ids", "logprobs", "versions")),
        loss_mask=cat("loss_mask"),
        segment_starts=[list(ep.segment_starts) for ep in episodes],
    )
