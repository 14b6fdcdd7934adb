"""The data path at boba scale, no model compute: rollout buffers -> tensor channel -> packed micro-batches.

    python -m benchmarks.data_path [--json PATH] [--prompts 512] [--samples 16] [--max-len 27000]
                                   [--transports shm zmq] [--mb-tokens 32768] [--workers 64] [--seconds 5]
                                   [--service-seconds 10] [--mix-from RUN_DIR] [--no-service] [--profile PATH]

(1) One synthetic boba batch (512 prompts x 16 samples; output lengths lognormal, median 4K,
    capped at 27K; prompts 256 tokens; token ids int32, logprobs float32, versions int32) goes the
    way the fleet moves it: per group, the rollout side's one tensor message (``TrajectoryBatch.group``,
    ``protocols.trajectories``) plus its ``TrajectoryReady`` control message (encoded), sent from a
    thread over the real channel; on the trainer side each group is received, split into
    per-sample views (``TrajectoryBatch.decode(...).samples()``), the control message decoded, and the
    batch becomes ``Trajectory`` objects and packed micro-batches (``allocate_micro_batches`` +
    ``pack``, ``--mb-tokens`` each), packed one after the other, each dropped before the next as
    the trainer does (``trainer.logprobs.iter_micro_batches``: pack, forward/backward, next).
    Timed from the first send to the last micro-batch packed, over one channel pair three
    times: the figure is the faster of the second and third batches (steady state: the shm slab
    pool is warm, as from a fleet's second batch on); the first is in ``first_batch_seconds``.
    torch runs one intra-op thread, as a fleet worker does (``cluster.torch_threads``).
    Two bounds, each one single-threaded copy between two warm buffers (``dst.copy_(src)``, best
    of three, measured in the same run just after the path), each its own row:
    - ``boba_batch_fraction_of_payload_memcpy``, the target row (>= 0.5 on shm): the copy of the
      payload bytes alone, the volume a skeptic would call the data (the row's first definition);
    - ``boba_batch_fraction_of_payload_and_packed_memcpy``: the copy of every byte the path has to
      write once, the payload (into the channel) plus the packed micro-batches (int64 ids and position
      ids, ``cu_seqlens``), which do not exist before packing (about 2.3x the bytes: the ratio is
      larger by as much). No target.
    (``boba_batch_fraction_of_memcpy`` is retired: it meant the payload alone when introduced and the
    payload plus the micro-batches two hours later, under the same name and target; recorded rows of
    both definitions keep it, and their ``bound_bytes`` says which.)
    Both are memcpy seconds / path seconds, per transport; ``cpu_fraction`` is the same ratio in
    CPU seconds (the bound's thread; the path's whole process, sender thread and ZeroMQ I/O
    threads included), which load does not inflate the way it inflates wall time.
(2) The scheduler's control plane on one core, two ways, each its own row:
    - ``scheduler_service_messages_per_s``: the real ``SchedulerService`` (its event loop, identity
      and role checks, ledger, run-log and status writes, replies and forwards) driven by a null
      fleet replaying a real run's message mix (``benchmarks.common.scheduler_load``; the mix is
      ``DEFAULT_MIX``, counted from a default run's ``summary.json``, or ``--mix-from RUN_DIR``),
      ``--service-seconds`` after 5 warm-up steps. This is the figure an extrapolation to a large
      fleet should rest on; it carries messages per CPU second and trainer steps per second.
    - ``scheduler_messages_per_s`` (the earlier figure, kept as it was defined): a bare ROUTER
      socket in this process draining a backlog that ``--workers`` simulated DEALERs in a child
      sent, each message decoded and applied to a ``SchedulerCore`` (``TrajectoryReady`` and
      ``RewardResult`` of groups of 16, plus one ``Heartbeat`` a group): no event loop, no
      identity check, no reply, no log write, and a third of the messages no-op heartbeats.

JSON rows: ``boba_batch_fraction_of_payload_memcpy`` and ``boba_batch_fraction_of_payload_and_packed_memcpy``
(``transport``, seconds, GB/s, bound GB/s, bytes), ``scheduler_service_messages_per_s``,
``scheduler_messages_per_s``. Every row records the 1-minute load average before and after. Dated
figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import zmq

from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.trainer.compute.packing import pack
from areal_async.trainer.compute.micro_batches import allocate_micro_batches
from areal_async.transport import make_tensor_channel
from benchmarks.common import scheduler_load, write_rows
from benchmarks.common.heartbeat_load import measure_heartbeats
from benchmarks.common.scheduler_load import Mix
from benchmarks.common.timing import Copier
from protocols.messages import Heartbeat, RewardResult, TrajectoryReady, decode, encode
from protocols.sockets import free_tcp_port
from protocols.trajectories import TrajectoryBatch

PROMPT_LEN = 256
MESSAGES_TARGET = 50_000  # the bare-socket figure's
SERVICE_TARGET = 20_000  # the real service's on one core (issue 40: >= 5x the 3.5-4.4k of 70d30db)
SERVICE_CONFIG = "configs/tiny_arith.yaml"
# what a default run's workers sent its scheduler per trainer step (summary.json of
# `areal-async run configs/tiny_arith.yaml`, see benchmarks/RESULTS.md for the run)
DEFAULT_MIX = Mix(
    heartbeats=1.39,  # 139 in 100 steps; per step they grow with the step's wall time (1 a worker a heartbeat_s)
    traj_groups=11,  # (3158 groups in 233 batches of TrajectoryReady + 74 lone ones) / 307 messages
    reward_groups=12,  # 3232 groups in 262 batches of RewardResult
    n_metrics=24,  # the trainer's metrics in a TrainStepDone (a metrics row less the scheduler's 15)
    source="areal-async run configs/tiny_arith.yaml total_train_steps=100 at b179fa4 (2026-12-01)",
    # that run's summary.json messages_received / 100 steps (4 registers and a TrainerReady left out), under
    # the names of its time: trajectories_ready and reward_results are now "batch:trajectory_ready" and
    # "batch:reward_result"
    per_step={
        "heartbeat": 1.39,
        "reward_results": 2.62,
        "train_step_done": 1.0,
        "trajectories_ready": 2.33,
        "trajectory_ready": 0.74,
        "weights_loaded": 2.0,
        "weights_published": 1.01,
    },
)


# --------------------------------------------------------------------------------------------
# (1) the boba batch
# --------------------------------------------------------------------------------------------


def boba_groups(n_prompts: int, n_samples: int, max_len: int, seed: int = 0) -> list[tuple[TrajectoryBatch, bytes]]:
    """Per group: (its trajectory batch, its encoded TrajectoryReady), as a rollout worker sends them."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(np.log(4000), 1.0, size=(n_prompts, n_samples)), max_len).astype(int).clip(1)
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = torch.randint(0, 151936, (PROMPT_LEN,), dtype=torch.int32, generator=g)
        samples = [
            (torch.randint(0, 151936, (n,), generator=g), -torch.rand(n, generator=g), torch.full((n,), 7))
            for n in map(int, lens[p])
        ]
        gid, sids = f"g{p}", [f"g{p}.{i}" for i in range(n_samples)]
        ready = encode(
            TrajectoryReady(
                group_id=gid,
                worker_id="rollout-0",
                n_prompt_tokens=PROMPT_LEN,
                sample_ids=sids,
                n_output_tokens=[int(n) for n in lens[p]],
                version_min=[7] * n_samples,
                version_max=[7] * n_samples,
                finish_reasons=["stop"] * n_samples,
            )
        )
        cols = (torch.cat(c) for c in zip(*samples))
        out.append((TrajectoryBatch.group(gid, sids, prompt, [int(n) for n in lens[p]], *cols), ready))
    return out


def payload_bytes(groups) -> int:
    return sum(batch.nbytes for batch, _ in groups)


def move_batch(kind: str, groups, mb_tokens: int, batches: int = 3) -> tuple[list[tuple[float, float]], int, int]:
    """((wall s, CPU s) per batch, micro-batches, bytes of the packed micro-batches): ``batches``
    times over one channel pair, send every group from a thread, receive, split, pack. The first
    batch fills the shm channel's slab pool (fresh pages fault in); a fleet's trainer receives
    every later batch into warm slabs."""
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    kw = {"run_id": f"dp{os.getpid()}"} if kind == "shm" else {}
    rx = make_tensor_channel(kind, role="receiver", endpoint=ep, **kw)
    tx = make_tensor_channel(kind, role="sender", endpoint=ep, **kw)
    try:
        out = []
        for _ in range(batches):
            secs, n_mb, packed_bytes = _one_batch(tx, rx, groups, mb_tokens)
            out.append(secs)
        return out, n_mb, packed_bytes
    finally:
        tx.close()
        rx.close()


def _one_batch(tx, rx, groups, mb_tokens: int) -> tuple[tuple[float, float], int, int]:
    ctl: list[bytes] = []

    def send() -> None:
        for batch, ready in groups:
            tx.send(*batch.encode())
            ctl.append(ready)  # the control message travels beside (its cost is the decode below)

    t0, c0 = time.perf_counter(), time.process_time()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    trajs = []
    for i in range(len(groups)):
        key, meta, tensors = rx.recv(timeout_s=120)
        while len(ctl) <= i:
            time.sleep(0)
        decode(ctl[i], (TrajectoryReady,))
        trajs += [v.scored(1.0) for v in TrajectoryBatch.decode(key, meta, tensors).samples()]
    mbs = allocate_micro_batches(
        [t.prompt_ids.numel() + t.output_ids.numel() for t in trajs], mb_tokens, oversize="own_mb"
    )
    packed_bytes = 0
    for mb in mbs:  # one at a time, as the trainer's iter_micro_batches (the model runs on each, then it goes)
        p = pack([trajs[i].seq_parts for i in mb])
        packed_bytes += sum(t.numel() * t.element_size() for t in (p.ids_T, p.position_ids_T, p.cu_seqlens))
    secs = (time.perf_counter() - t0, time.process_time() - c0)
    sender.join()
    return secs, len(mbs), packed_bytes


def transfer_rows(transports: list[str], groups, mb_tokens: int) -> list[dict]:
    size = payload_bytes(groups)
    rows = []
    for kind in transports:
        per_batch, n_mb, packed = move_batch(kind, groups, mb_tokens)
        # steady state (warm slabs, as from a fleet's second batch on): best of 2, as the bound is of 3
        secs, cpu = min(w for w, _ in per_batch[1:]), min(c for _, c in per_batch[1:])
        common = {
            "transport": kind,
            "seconds": secs,
            "first_batch_seconds": per_batch[0][0],
            "cpu_seconds": cpu,
            "gbps": size / secs / 1e9,
            "bytes": size,
            "packed_bytes": packed,
            "n_groups": len(groups),
            "n_micro_batches": n_mb,
        }
        for metric, nbytes in (
            (TARGET_ROW, size),  # the payload alone
            ("boba_batch_fraction_of_payload_and_packed_memcpy", size + packed),  # and the micro-batches once
        ):
            bound, bound_cpu = memcpy_bound(nbytes)
            rows.append(bound_row(metric, kind, bound, bound_cpu, nbytes, common))
    return rows


TARGET_ROW = "boba_batch_fraction_of_payload_memcpy"  # the payload alone: its definition since it was added


def memcpy_bound(nbytes: int) -> tuple[float, float]:
    """(wall s, CPU s) of one warm single-threaded copy of ``nbytes``, each the best of three."""
    copier = Copier(nbytes, "cpu")
    try:
        return min(copier.sample() for _ in range(3)), min(_cpu_seconds(copier.sample) for _ in range(3))
    finally:
        del copier


def bound_row(metric: str, kind: str, bound: float, bound_cpu: float, nbytes: int, common: dict) -> dict:
    """A fraction-of-memcpy row: the bound's seconds over the path's (wall and CPU); target on shm."""
    value = bound / common["seconds"]
    target = 0.5 if metric == TARGET_ROW else None  # met or not on shm only
    return {
        "metric": metric,
        "value": value,
        "unit": "fraction",
        **common,
        "cpu_fraction": bound_cpu / common["cpu_seconds"],
        "bound_gbps": nbytes / bound / 1e9,
        "bound_bytes": nbytes,
        "target": target,
        "meets_target": value >= target if target is not None and kind == "shm" else None,
    }


def _cpu_seconds(fn) -> float:
    c0 = time.thread_time()
    fn()
    return time.thread_time() - c0


# --------------------------------------------------------------------------------------------
# (2) the scheduler's control plane
# --------------------------------------------------------------------------------------------


def _simulated_workers(
    endpoint: str, groups: list[tuple[str, list[str]]], n_workers: int, cpus: list[int], sent, done
) -> None:
    """Child process: DEALERs that send each issued group's TrajectoryReady and RewardResult, and
    heartbeats. Every frame is encoded first, then all are sent (``sent`` set after), so the
    scheduler side drains a backlog: its rate is its own, not this process's encoding speed."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(n_workers)]
    for i, s in enumerate(socks):
        s.setsockopt(zmq.IDENTITY, f"w{i}".encode())
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(endpoint)
    frames = []
    for k, (gid, sids) in enumerate(groups):
        n = len(sids)
        ready = TrajectoryReady(
            group_id=gid,
            worker_id="r",
            n_prompt_tokens=8,
            sample_ids=sids,
            n_output_tokens=[4] * n,
            version_min=[0] * n,
            version_max=[0] * n,
            finish_reasons=["stop"] * n,
        )
        scored = RewardResult(
            group_id=gid, worker_id="w", sample_ids=sids, scores=[1.0] * n, statuses=["ok"] * n, details=[""] * n
        )
        beat = Heartbeat(worker_id=f"w{k % n_workers}", ts=time.time(), stats={"busy_s": 1.0})
        frames += [(socks[k % n_workers], encode(m)) for m in (ready, scored, beat)]
    for sock, frame in frames:
        sock.send(frame)
    sent.set()
    done.wait(600)
    for s in socks:
        s.close(0)
    ctx.term()


def scheduler_rows(n_workers: int, seconds: float) -> list[dict]:
    cpus = sorted(os.sched_getaffinity(0))
    params = SchedulerParams(
        batch_size=10**9,
        n_samples=16,
        eta=10**6,
        total_steps=10**9,
        max_concurrent=10**9,
        gen=dict(max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False, stop_token_ids=[]),
    )
    n_groups = min(int(seconds * MESSAGES_TARGET / 3), 20_000)  # 3 messages per group; the ledger stays small
    params.max_concurrent = n_groups
    core = SchedulerCore(params, _Prompts(), lambda idx: ([1, 2, 3], ["7"]))
    core.add_rollout("r")
    core.on_trainer_ready(0, 0)
    issued = [(req.group_id, list(req.sample_ids)) for _, req in core.admit()]
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind(ep)
    spawn = mp.get_context("spawn")
    sent, done = spawn.Event(), spawn.Event()
    child = spawn.Process(target=_simulated_workers, args=(ep, issued, n_workers, cpus[1:], sent, done))
    child.start()
    handlers = {TrajectoryReady: core.on_trajectory, RewardResult: core.on_reward, Heartbeat: lambda m: None}
    n, t0, total = 0, None, 3 * len(issued)
    try:
        if not sent.wait(600):
            raise RuntimeError("the simulated workers did not send their messages within 600 s")
        if cpus:
            os.sched_setaffinity(0, cpus[:1])  # the scheduler side: one core
        while n < total and router.poll(5000) and (t0 is None or time.perf_counter() - t0 < seconds):
            if t0 is None:
                t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(min(256, total - n)):  # drain what is queued: one poll per wakeup, not per frame
                try:
                    router.recv(zmq.NOBLOCK)  # the sender's identity; the payload frame is there with it
                except zmq.Again:
                    break
                data = router.recv()
                if router.rcvmore:  # a DEALER sends one frame; anything more is a malformed message
                    raise RuntimeError(f"a simulated worker sent a multipart message: {router.recv_multipart()}")
                msg = decode(data)
                handlers[type(msg)](msg)
                n += 1
        secs, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        os.sched_setaffinity(0, cpus)
        done.set()
        scheduler_load.reap(child)
        router.close(0)
        ctx.term()
    rate = n / secs
    return [
        {
            "metric": "scheduler_messages_per_s",
            "value": rate,
            "unit": "messages/s",
            "workers": n_workers,
            "messages": n,
            "seconds": secs,
            "cpu_seconds": cpu,
            "messages_per_cpu_s": n / cpu,
            "mix": "TrajectoryReady + RewardResult (16 samples each) + Heartbeat",
            "target": MESSAGES_TARGET,
            "meets_target": rate >= MESSAGES_TARGET,
        }
    ]


def service_rows(config: str, overrides: list[str], mix: Mix, seconds: float, profile: str | None = None) -> list[dict]:
    """``scheduler_service_messages_per_s``: the real SchedulerService under the mix
    (``benchmarks.common.scheduler_load.measure``; ``profile``: a cProfile window after it)."""
    m = scheduler_load.measure(config, overrides, mix, seconds, profile=profile)
    rate = m.pop("value")
    return [
        {
            "metric": "scheduler_service_messages_per_s",
            "value": rate,
            "unit": "messages/s",
            **m,
            "config": config,
            "overrides": overrides,
            "mix": asdict(mix),
            "target": SERVICE_TARGET,
            "meets_target": rate >= SERVICE_TARGET,
        }
    ]


def heartbeat_rows(config: str, rates: list[float], seconds: float) -> list[dict]:
    """``scheduler_service_heartbeat_core_frac`` per rate: the real service's share of its core at that many
    lone heartbeats a second, nothing else flowing (``benchmarks.common.heartbeat_load``)."""
    return [
        {"metric": "scheduler_service_heartbeat_core_frac", "unit": "cores", **measure_heartbeats(config, r, seconds)}
        for r in rates
    ]


class _Prompts:
    """A prompt cursor for the simulation: always problem 0, fresh prompt ids."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> tuple[int, str]:
        self.n += 1
        return 0, f"p{self.n}"


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def mix_of(run_dir: str | None) -> Mix:
    """The message mix of a real run (its summary.json), or ``DEFAULT_MIX``."""
    if not run_dir:
        return DEFAULT_MIX
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    if "messages_received" not in summary:
        raise SystemExit(f"{run_dir}/summary.json has no messages_received (a run of an earlier version?)")
    return Mix.of_summary(summary, source=str(run_dir))


def describe(r: dict) -> str:
    """The printed line's detail for a row."""
    if "transport" in r:
        return (
            f"{r['transport']}: {r['seconds']:.2f} s, {r['gbps']:.2f} GB/s vs memcpy {r['bound_gbps']:.2f} GB/s "
            f"of {r['bound_bytes'] / 1e9:.2f} GB; CPU-time fraction {r['cpu_fraction']:.3f}"
        )
    if r["metric"] == "scheduler_service_heartbeat_core_frac":
        return (
            f"{r['heartbeats_per_s']:.0f} lone heartbeats/s through the real service: {r['cpu_us_per_heartbeat']:.0f} "
            "CPU-us each"
        )
    if r["metric"] == "scheduler_service_messages_per_s":
        return (
            f"real service, {r['messages']} messages in {r['seconds']:.1f} s, {r['messages_per_cpu_s']:.0f} per "
            f"CPU-s, {r['steps_per_s']:.1f} steps/s, {r['samples_trained_per_s']:.0f} samples/s; bound: {r['bound']} "
            f"(null fleet CPU {r['null_fleet_cpu_frac']:.2f} core)"
        )
    return (
        f"bare socket, {r['workers']} simulated workers, {r['messages']} messages, "
        f"{r['messages_per_cpu_s']:.0f} per CPU-s"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=27000)
    ap.add_argument("--transports", nargs="+", default=["shm", "zmq"])
    ap.add_argument("--mb-tokens", type=int, default=32768)
    ap.add_argument("--workers", type=int, default=64, help="bare-socket figure: simulated workers")
    ap.add_argument("--seconds", type=float, default=5.0, help="bare-socket figure: seconds")
    ap.add_argument("--service-seconds", type=float, default=10.0, help="real-service figure: seconds")
    ap.add_argument("--mix-from", default=None, help="a run dir whose summary.json gives the message mix")
    ap.add_argument("--no-service", action="store_true", help="skip the real-service figure")
    ap.add_argument("--no-batch", action="store_true", help="skip the boba batch (scheduler figures only)")
    ap.add_argument(
        "--profile", default=None, help="real service: a 5 s cProfile window after the measured one, to PATH"
    )
    ap.add_argument(
        "--heartbeat-rates", type=float, nargs="*", default=[], help="real service: its core share at each rate"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as a fleet worker (cluster.torch_threads = 1); the bound is one thread too
    load0 = os.getloadavg()[0]
    rows = []
    if not args.no_batch:
        groups = boba_groups(args.prompts, args.samples, args.max_len)
        rows += transfer_rows(args.transports, groups, args.mb_tokens)
        del groups
    if not args.no_service:
        rows += service_rows(SERVICE_CONFIG, [], mix_of(args.mix_from), args.service_seconds, args.profile)
    rows += heartbeat_rows(SERVICE_CONFIG, args.heartbeat_rates, args.service_seconds)
    rows += scheduler_rows(args.workers, args.seconds)
    for r in rows:
        r.update(loadavg_before=load0, loadavg_after=os.getloadavg()[0], cpu_count=os.cpu_count())
        print(
            f"{r['metric']:<50} {r['value']:>12.3f} {r['unit']:<11} {describe(r)}  (target {r.get('target')}, "
            f"{'met' if r.get('meets_target') else 'NOT met' if r.get('meets_target') is False else '-'})"
        )
    print(f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs")
    if args.json:
        write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
