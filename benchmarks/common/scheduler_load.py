"""Scheduler messages/s through the real ``SchedulerService``, driven by a null fleet.

The service is the one a run uses (``scheduler/service.py``: its event loop on uvloop, the drain of
queued frames, per-message identity and role checks, the ledger, ``metrics.jsonl`` and
``trajectories.jsonl`` written through ``RunLog``, ``status.json`` every heartbeat, replies and
forwards: a ``Batch`` of ``GenerateRequest``, ``BatchPlan``, ``WeightsPublished`` to every rollout worker),
built from a real config (default ``configs/tiny_arith.yaml``) on an ipc control socket, in this
process, pinned to one CPU. Its peers are a null fleet in a child process on the other CPUs: the
config's trainer, rollout and reward workers as DEALER sockets that register and then answer at
once, with no model and no compute, in the protocol's order: a rollout worker answers its
requests with a ``Batch`` of ``TrajectoryReady`` (``traj_groups`` groups a message) and the
reward worker scores those groups in a ``Batch`` of ``RewardResult`` (``reward_groups`` a message); every
rollout worker answers ``WeightsPublished`` with ``WeightsLoaded``; the trainer answers each
``BatchPlan`` with ``WeightsPublished`` (a real shm manifest of the config's model) and
``TrainStepDone`` (``n_metrics`` metrics); ``heartbeats`` per step come round-robin from the
workers. The mix (``Mix``) is what a real run sent: ``Mix.of_summary`` reads it from a run's
``summary.json`` (``messages_received`` by type, ``groups_in_batched_messages``, per step; a run from before
the generic ``Batch`` counted ``trajectories_ready`` and ``reward_results`` instead, read as the same).

Measured over ``seconds`` after ``warmup_steps`` trainer steps: messages the service took per
wall second and per CPU second of this process (the service's thread and ZeroMQ's I/O thread),
trainer steps and groups per second, and the null fleet's CPU share: near a whole core, the
fleet may have been what bounded the rate (``bound`` says which). Not measured: CURVE on tcp
(the default control plane is ipc), workers on other hosts, checkpoints.

After the window the fleet is stopped first (its sockets flushed: a ``LINGER_MS`` close) and the service
runs on until what it received stops moving (``DRAIN_QUIET_S``): ``fleet_counts`` (the null fleet's own
count of what each of its workers sent and got, by message type, in its process) and ``drained_received``
(the service's count over the whole run) are then two independent counts of the same messages.

``profile`` (a path): after the measured window, a second window of ``profile_seconds`` under
``cProfile`` (the service's thread: its event loop and everything it calls), its stats written
there (``pstats``); the measured window is never profiled, so its figure carries no profiler cost.
"""

from __future__ import annotations

import asyncio
import cProfile
import multiprocessing as mp
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import zmq

from areal_async.base.control import routing_identity
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import Roster, write_run_keys
from areal_async.config import load_config
from areal_async.data.prompts import prompt_encoder
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.scheduler.service import SchedulerService
from areal_async.transport import buckets
from benchmarks.common.cpu import proc_cpu_s
from protocols import messages as M
from protocols.sockets import ipc_endpoint, make_socket, run_async

WARMUP_STEPS = 5
WARMUP_TIMEOUT_S = float(os.environ.get("AREAL_BENCH_WARMUP_TIMEOUT_S", 120))
FLEET_LIMIT_S = 900.0  # the null fleet's own way out, should the service never shut it down
FLEET_BUSY = 0.9  # the null fleet's CPU share (of one core) above which it may have bounded the rate
LINGER_MS = 5000  # the fleet's sockets deliver what they hold before they close
DRAIN_QUIET_S = 0.5  # the service has drained once its received counts stay put this long


@dataclass
class Mix:
    """Per trainer step, what a run's workers send the scheduler (see the module docstring)."""

    heartbeats: float
    traj_groups: int  # groups per Batch of TrajectoryReady (1: a lone TrajectoryReady)
    reward_groups: int  # groups per Batch of RewardResult (1: a lone RewardResult)
    n_metrics: int = 30  # metrics per TrainStepDone
    source: str = ""
    per_step: dict = field(default_factory=dict)  # the run's messages per step, by type (to compare with)

    @classmethod
    def of_summary(cls, summary: dict, n_metrics: int = 30, source: str = "") -> "Mix":
        """From a run's summary.json: heartbeats per step, groups per trajectory and reward message."""
        got, groups, steps = summary["messages_received"], summary["groups_in_batched_messages"], summary["steps"]

        def per_message(single: str, before_batch: str) -> int:
            batched = f"batch:{single}" if f"batch:{single}" in got else before_batch
            n_msgs = got.get(batched, 0) + got.get(single, 0)
            return max(1, round((groups.get(batched, 0) + got.get(single, 0)) / max(1, n_msgs)))

        return cls(
            heartbeats=got.get("heartbeat", 0) / max(1, steps),
            traj_groups=per_message("trajectory_ready", "trajectories_ready"),
            reward_groups=per_message("reward_result", "reward_results"),
            n_metrics=n_metrics,
            source=source,
            per_step=per_step(got, steps),
        )


def per_step(received: dict[str, int], steps: int) -> dict[str, float]:
    """Messages by type per trainer step."""
    return {k: v / max(1, steps) for k, v in sorted(received.items())}


# --------------------------------------------------------------------------------------------
# the null fleet (child process)
# --------------------------------------------------------------------------------------------


class NullFleet:
    """The config's workers as DEALERs answering the scheduler at once (see the module docstring)."""

    def __init__(self, control: str, roles: dict[str, str], tokens: dict[str, str], mix: Mix, manifest: dict):
        self.ctx, self.mix, self.manifest = zmq.Context(), mix, manifest
        self.socks = {
            wid: make_socket(self.ctx, zmq.DEALER, connect=control, identity=routing_identity(wid)) for wid in roles
        }
        self.roles, self.tokens, self.wid_of = roles, tokens, {s: w for w, s in self.socks.items()}
        self.reward = next(w for w, r in roles.items() if r == "reward")
        self.beat_debt, self.beat_next, self.errors, self.ended = 0.0, 0, [], False
        self.pending: dict[str, list[tuple[str, list[str], int]]] = {}  # rollout worker -> groups not yet answered
        self.metrics = {f"metric_{i}": 0.5 for i in range(mix.n_metrics)}
        self.counts: dict[str, int] = {}  # "sent <type> <worker>" / "got <type> <worker>": this process's own

    def count(self, what: str, wid: str, msg: M.Message) -> None:
        key = f"{what} {msg.TYPE} {wid}"
        self.counts[key] = self.counts.get(key, 0) + 1

    def send(self, wid: str, msg: M.Message) -> None:
        self.socks[wid].send(M.encode(msg))
        self.count("sent", wid, msg)

    def start(self) -> None:
        for wid, role in self.roles.items():
            self.send(wid, M.Register(role=role, worker_id=wid, pid=os.getpid(), token=self.tokens[wid]))
        for wid in self.roles:
            if not self.socks[wid].poll(30_000):
                raise TimeoutError(f"null fleet: no RegisterAck for {wid} within 30 s")
            ack = M.decode(self.socks[wid].recv())
            if not isinstance(ack, M.RegisterAck):
                raise RuntimeError(f"null fleet: {wid} got {ack!r} instead of a RegisterAck")
        self.send("trainer", M.WeightsPublished(version=0, manifest=self.manifest))
        self.send("trainer", M.TrainerReady(version=0, next_step=0))

    def serve(self, stop, limit_s: float) -> None:
        """Answer until the trainer's Shutdown, ``stop`` is set, or ``limit_s`` passes."""
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + limit_s
        while not self.ended and not stop.is_set() and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                while not self.ended:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_message(self.wid_of[sock], M.decode(frame))
            self.flush()

    def on_message(self, wid: str, msg: M.Message) -> None:
        self.count("got", wid, msg)
        if isinstance(msg, (M.Batch, M.GenerateRequest)):  # the scheduler batches only generate requests
            self.pending.setdefault(wid, []).extend(_groups(msg))
        elif isinstance(msg, M.WeightsPublished):
            self.send(wid, M.WeightsLoaded(worker_id=wid, version=msg.version))
        elif isinstance(msg, M.BatchPlan):
            self.send(wid, M.WeightsPublished(version=msg.step + 1, manifest=self.manifest))
            self.send(wid, M.TrainStepDone(step=msg.step, version=msg.step + 1, metrics=self.metrics))
            self.beats(self.mix.heartbeats)
        elif isinstance(msg, M.Shutdown):
            self.ended = self.ended or wid == "trainer"
        elif isinstance(msg, M.Error):
            self.errors.append(f"{wid}: {msg.code}: {msg.detail}")

    def flush(self) -> None:
        """The groups every rollout worker was given since the last flush (all the frames that had
        arrived by then): finished together, as an engine step finishes the groups it decoded."""
        for wid, groups in self.pending.items():
            self.generated(wid, groups)
        self.pending = {}

    def generated(self, wid: str, groups: list[tuple[str, list[str], int]]) -> None:
        for chunk in _chunks(groups, self.mix.traj_groups):
            ready = [_ready(gid, sids, wid, version) for gid, sids, version in chunk]
            self.send(wid, M.batched(ready))
        for chunk in _chunks(groups, self.mix.reward_groups):  # a reward worker always sends a Batch
            self.send(self.reward, _scored(chunk, self.reward))

    def beats(self, n: float) -> None:
        self.beat_debt += n
        wids = list(self.socks)
        while self.beat_debt >= 1:
            wid = wids[self.beat_next % len(wids)]
            self.send(wid, M.Heartbeat(worker_id=wid, ts=time.time(), stats=_stats(self.roles[wid])))
            self.beat_next, self.beat_debt = self.beat_next + 1, self.beat_debt - 1

    def close(self) -> None:
        for s in self.socks.values():
            s.close(LINGER_MS)  # what was sent is delivered: the service's count can match the fleet's
        self.ctx.term()


def _groups(msg) -> list[tuple[str, list[str], int]]:
    """(group id, sample ids, the version its tokens come from: the request's min_version)."""
    return [(r.group_id, list(r.sample_ids), r.min_version) for r in M.unbatch(msg)]


def _chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), max(1, n))]


def _ready(gid: str, sids: list[str], wid: str, version: int) -> M.TrajectoryReady:
    n = len(sids)
    return M.TrajectoryReady(
        group_id=gid,
        worker_id=wid,
        n_prompt_tokens=8,
        sample_ids=sids,
        n_output_tokens=[8] * n,
        version_min=[version] * n,
        version_max=[version] * n,
        finish_reasons=["stop"] * n,
    )


def _scored(groups: list[tuple[str, list[str], int]], wid: str) -> M.Batch:
    """As ``reward.service.RewardService._results`` builds it: every sample scored 1.0, ok."""
    return M.Batch.of(
        [M.RewardResult(g, wid, list(s), [1.0] * len(s), ["ok"] * len(s), [""] * len(s)) for g, s, _ in groups]
    )


def _stats(role: str) -> dict:
    return {"samples": 1000, "busy_s": 1.5, "waiting_for": f"the {role}'s next message"}


def _null_fleet_main(control: str, roles: dict, tokens: dict, mix: dict, manifest: dict, cpus: list, stop, q) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    fleet = NullFleet(control, roles, tokens, Mix(**mix), manifest)
    try:
        fleet.start()
        fleet.serve(stop, FLEET_LIMIT_S)
    finally:
        fleet.close()
        q.put((fleet.errors, fleet.counts))


def shm_manifest(cfg) -> dict:
    """A real shm weight manifest (``transport.buckets``) for the config's model: what the trainer's
    ``WeightsPublished`` carries and the scheduler forwards to every rollout worker."""
    sd = build_model(cfg.model, len(load_tokenizer(cfg.model.path)), cfg.seed).state_dict()
    layout = buckets.plan(sd, int(cfg.tensor_channel.bucket_mb * (1 << 20)))
    handle = {"segment": "areal-null-fleet", "size": layout.total}
    return buckets.manifest("shm", 0, layout, "none", None, handle)


# --------------------------------------------------------------------------------------------
# the service (this process) and the measurement
# --------------------------------------------------------------------------------------------


def reap(child, grace_s: float = 30.0) -> None:
    """Join a child process told to stop; terminate it after ``grace_s``."""
    child.join(grace_s)
    if child.is_alive():
        child.terminate()
        child.join()


@contextmanager
def service_dir(cfg, prefix: str) -> Iterator[tuple[RunManifest, Path, dict, dict]]:
    """A temporary run for a service measured in this process: its endpoints, run directory, the roles of
    ``cfg`` and their keys (registrations are checked against a real roster); removed on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        ep = RunManifest(ipc_endpoint(tmp, "c"), ipc_endpoint(tmp, "t"), [], tmp)
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        roles = roles_of(cfg)
        yield ep, run_dir, roles, write_run_keys(run_dir, roles)


def roles_of(cfg) -> dict[str, str]:
    """Worker id -> role of the config's fleet (the ids the supervisor gives them)."""
    roles = {"trainer": "trainer"}
    roles.update({f"rollout-{i}": "rollout" for i in range(cfg.cluster.n_rollout_workers)})
    roles.update({f"reward-{i}": "reward" for i in range(cfg.cluster.n_reward_workers)})
    return roles


def measure(
    config: str,
    overrides: list[str],
    mix: Mix,
    seconds: float,
    warmup_steps: int = WARMUP_STEPS,
    profile: str | None = None,
    profile_seconds: float = 5.0,
) -> dict:
    """One measurement (see the module docstring); returns the row's fields."""
    cfg = load_config(config, ["total_train_steps=1000000000", *overrides])
    cpus = sorted(os.sched_getaffinity(0))
    with service_dir(cfg, "sched-") as (ep, run_dir, roles, tokens):
        spawn = mp.get_context("spawn")
        stop, q = spawn.Event(), spawn.Queue()
        args = (ep.control, roles, tokens, asdict(mix), shm_manifest(cfg), cpus[1:], stop, q)
        child = spawn.Process(target=_null_fleet_main, args=args, daemon=True)
        if cpus:
            os.sched_setaffinity(0, cpus[:1])
        try:
            child.start()
            prof = (profile, profile_seconds) if profile else None
            out = run_async(_serve_and_watch(cfg, ep, run_dir, (child, stop), seconds, warmup_steps, prof))
        finally:
            os.sched_setaffinity(0, cpus)
            stop.set()
            reap(child)
        errors, counts = q.get(timeout=5) if not q.empty() else (["the null fleet reported nothing"], {})
    return out | {"fleet_errors": errors[:5], "n_fleet_errors": len(errors), "fleet_counts": counts}


async def _serve_and_watch(
    cfg, ep: RunManifest, run_dir: Path, fleet, seconds: float, warmup: int, prof: tuple | None = None
) -> dict:
    """The service in this process: the window after ``warmup`` steps, (``prof``: (path, seconds)) a
    profiled window, then the fleet (``(process, stop event)``) stopped and the service drained
    (``_drain``) before it stops."""
    child, stop = fleet
    fleet_pid = child.pid
    encode = prompt_encoder(load_tokenizer(cfg.model.path), cfg.train_dataset.template)
    svc = SchedulerService(cfg, ep, run_dir, t0=time.time(), tokenize=encode, roster=Roster.of_run(run_dir))
    task = asyncio.create_task(svc.run())
    try:
        start = await _when(svc, lambda: svc.core.next_step >= warmup, timeout_s=WARMUP_TIMEOUT_S, fleet_pid=fleet_pid)
        await asyncio.sleep(seconds)
        end = _snapshot(svc, fleet_pid)
        if prof is not None:
            await _profiled(prof[0], prof[1])
        drained = await _drain(svc, child, stop)
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 10)
    return _window(start, end, svc) | {"drained_received": drained}


async def _drain(svc, child, stop) -> dict:
    """Stop the fleet, wait for it to exit (its sockets flushed), then for the service's received counts to
    stay put ``DRAIN_QUIET_S``: its count of the whole run, to hold against the fleet's own."""
    stop.set()
    deadline = time.monotonic() + 60
    while child.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    last, quiet_since = None, time.monotonic()
    while time.monotonic() - quiet_since < DRAIN_QUIET_S and time.monotonic() < deadline:
        now = dict(svc.received)
        if now != last:
            last, quiet_since = now, time.monotonic()
        await asyncio.sleep(0.05)
    return last or {}


async def _profiled(path: str, seconds: float) -> None:
    """``seconds`` of the service under cProfile, the stats written to ``path``."""
    p = cProfile.Profile()
    p.enable()
    try:
        await asyncio.sleep(seconds)
    finally:
        p.disable()
        p.dump_stats(path)


async def _when(svc, cond, timeout_s: float, fleet_pid: int) -> dict:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc_cpu_s(fleet_pid) is None:
            raise RuntimeError("the null fleet exited before the scheduler reached its warm-up steps (see above)")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the scheduler reached step {svc.core.next_step} in {timeout_s} s; it waits for {svc.waiting_for()}"
            )
        await asyncio.sleep(0.01)
    return _snapshot(svc, fleet_pid)


def _snapshot(svc, fleet_pid: int) -> dict:
    return {
        "t": time.perf_counter(),
        "cpu": time.process_time(),
        "fleet_cpu": proc_cpu_s(fleet_pid) or 0.0,
        "received": dict(svc.received),
        "step": svc.core.next_step,
        "version": svc.core.version,
        "owed": weights_owed(svc.core),
        "samples": svc.core.ledger.n_trained,
    }


def weights_owed(core) -> int:
    """WeightsLoaded the rollout workers still owe: per worker, the versions the trainer has
    finished that it has not acknowledged. A window's ``weights_loaded`` count is then exactly
    ``n_rollouts * versions advanced - (owed at its end - owed at its start)``: what the per-step
    mix cannot hold to better than the acknowledgements in flight at its two ends."""
    return sum(core.version - r.loaded_version for r in core.rollouts.values())


def _window(a: dict, b: dict, svc) -> dict:
    wall, cpu = b["t"] - a["t"], b["cpu"] - a["cpu"]
    received = {k: v - a["received"].get(k, 0) for k, v in b["received"].items()}
    n, steps = sum(received.values()), b["step"] - a["step"]
    fleet_frac = (b["fleet_cpu"] - a["fleet_cpu"]) / wall
    return {
        "value": n / wall,
        "messages": n,
        "seconds": wall,
        "cpu_seconds": cpu,
        "messages_per_cpu_s": n / cpu if cpu > 0 else None,
        "service_cpu_frac": cpu / wall,
        "null_fleet_cpu_frac": fleet_frac,
        "bound": "null fleet (it used ~a core)" if fleet_frac >= FLEET_BUSY else "scheduler service",
        "steps": steps,
        "steps_per_s": steps / wall,
        "samples_trained_per_s": (b["samples"] - a["samples"]) / wall,
        "mix_per_step": per_step(received, steps),
        "received": received,
        "versions": b["version"] - a["version"],
        "weights_owed": [a["owed"], b["owed"]],
    }
