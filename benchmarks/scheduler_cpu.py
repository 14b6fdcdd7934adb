"""The real SchedulerService's own CPU per trainer step, with no sockets: what its Python costs.

    python -m benchmarks.scheduler_cpu [--steps 1000] [--warmup 5] [--heartbeats H] [--rollouts N] [--json PATH]
                                       [--profile PATH]

The service (``scheduler/service.py``, built from ``configs/tiny_arith.yaml`` as ``benchmarks.data_path`` builds
it) is driven in this thread by the null fleet's own logic (``scheduler_load.NullFleet``: the same answers, the
same mix, ``DEFAULT_MIX`` unless ``--heartbeats`` sets its heartbeats per step): each round hands the fleet's
frames to the service's frame handler (``_take``, up to ``DRAIN_MAX`` frames, then one ``_drive`` unless none of
them moved anything, as its router's serve loop does per wakeup) and the service's replies to the fleet. Its
books, lines and replies are the real ones; what it does not have is ZeroMQ (sends and receives, the I/O
thread), the event loop's wakeups and a second process. The fleet's time is taken out (``thread_time`` around
its calls), so ``service_cpu_ms_per_step`` is the service's CPU alone: a figure the machine's load moves much
less than wall time, for comparing two versions of the service's code in one sitting. It is not the figure to
extrapolate from (that is ``benchmarks.data_path``'s ``scheduler_service_messages_per_s``: the real socket and
loop on one core). ``--rollouts N``: N rollout workers (``cluster.n_rollout_workers``; the config has 2), for
what grows with the fleet: every rollout worker gets each ``WeightsPublished`` and answers ``WeightsLoaded``,
and B groups a step spread over N workers come back in more, smaller messages. ``--profile``: a cProfile of the
measured steps (the fleet's calls in it too).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import tempfile
import time
from pathlib import Path

from areal_async.base.control import routing_identity
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import Roster, write_run_keys
from areal_async.config import load_config
from areal_async.data.prompts import prompt_encoder
from areal_async.models.tokenizer import load_tokenizer
from areal_async.scheduler.router import DRAIN_MAX
from areal_async.scheduler.service import SchedulerService
from benchmarks.common import scheduler_load as sl, write_rows
from benchmarks.data_path import DEFAULT_MIX, SERVICE_CONFIG
from protocols import messages as M
from protocols.sockets import ipc_endpoint


class InProcessFleet(sl.NullFleet):
    """``NullFleet``'s answers, its frames kept in ``inbox`` for the service instead of sent on a socket."""

    def __init__(self, roles: dict[str, str], tokens: dict[str, str], mix: sl.Mix, manifest: dict):
        self.mix, self.manifest, self.roles, self.tokens = mix, manifest, roles, tokens
        self.reward = next(w for w, r in roles.items() if r == "reward")
        self.beat_debt, self.beat_next, self.errors, self.ended = 0.0, 0, [], False
        self.pending, self.counts, self.inbox = {}, {}, []
        self.metrics = {f"metric_{i}": 0.5 for i in range(mix.n_metrics)}
        self.ident = {w: routing_identity(w).encode() for w in roles}
        self.wid_of = {v: k for k, v in self.ident.items()}
        self.socks = dict.fromkeys(roles)  # NullFleet.beats walks the worker ids in this order

    def send(self, wid: str, msg: M.Message) -> None:
        self.inbox.append([self.ident[wid], M.encode(msg)])
        self.count("sent", wid, msg)


class Driver:
    """The service and the fleet, one round at a time (``round``); ``fleet_cpu``: the fleet's thread seconds."""

    def __init__(self, svc: SchedulerService, fleet: InProcessFleet):
        self.svc, self.fleet, self.outbox, self.fleet_cpu = svc, fleet, [], 0.0

        async def keep(frames: list) -> None:  # the service's sends, kept for the fleet
            self.outbox.append(frames)

        svc.router.send_frames = keep

    async def round(self) -> None:
        frames, self.fleet.inbox = self.fleet.inbox, []
        for i in range(0, len(frames), DRAIN_MAX):
            moved = False
            for f in frames[i : i + DRAIN_MAX]:  # False: nothing a drive acts on (a service before ba62dfe: None)
                moved = await self.svc._take(f) is not False or moved
            if moved:  # as the router's serve loop: no drive after frames that change nothing it acts on
                await self.svc._drive()
        replies, self.outbox = self.outbox, []
        t = time.thread_time()
        for ident, data in replies:
            self.fleet.on_message(self.fleet.wid_of[ident], M.decode(data))
        self.fleet.flush()
        self.fleet_cpu += time.thread_time() - t

    async def until(self, step: int, max_rounds: int = 1_000_000) -> None:
        for _ in range(max_rounds):
            if self.svc.core.next_step >= step:
                return
            if not self.fleet.inbox:
                raise RuntimeError(
                    f"the fleet has nothing to send at step {self.svc.core.next_step}: {self.svc.waiting_for()}"
                )
            await self.round()
        raise RuntimeError(f"step {step} not reached in {max_rounds} rounds")


async def measure(mix: sl.Mix, steps: int, warmup: int = 5, profile: str | None = None, rollouts: int = 0) -> dict:
    """``steps`` trainer steps after ``warmup``: the service's CPU per step and per message (see the docstring);
    ``rollouts`` > 0: that many rollout workers instead of the config's."""
    over = [f"cluster.n_rollout_workers={rollouts}"] if rollouts > 0 else []
    cfg = load_config(SERVICE_CONFIG, ["total_train_steps=1000000000", *over])
    with tempfile.TemporaryDirectory(prefix="sched-cpu-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        roles = sl.roles_of(cfg)
        tokens = write_run_keys(run_dir, roles)
        ep = RunManifest(ipc_endpoint(tmp, "c"), ipc_endpoint(tmp, "t"), [], tmp)
        encode = prompt_encoder(load_tokenizer(cfg.model.path), cfg.train_dataset.template)
        svc = SchedulerService(cfg, ep, run_dir, t0=time.time(), tokenize=encode, roster=Roster.of_run(run_dir))
        fleet = InProcessFleet(roles, tokens, mix, sl.shm_manifest(cfg))
        drive = Driver(svc, fleet)
        try:
            for wid, role in roles.items():
                fleet.send(wid, M.Register(role=role, worker_id=wid, pid=os.getpid(), token=tokens[wid]))
            await drive.round()
            fleet.send("trainer", M.WeightsPublished(version=0, manifest=fleet.manifest))
            fleet.send("trainer", M.TrainerReady(version=0, next_step=0))
            await drive.until(warmup)
            return await _window(drive, warmup + steps, profile) | {"rollouts": len(svc.role("rollout"))}
        finally:
            svc.runlog.close()
            svc.router.close()


async def _window(drive: Driver, end: int, profile: str | None) -> dict:
    svc = drive.svc
    got0, step0, trained0 = sum(svc.received.values()), svc.core.next_step, svc.core.ledger.n_trained
    prof = cProfile.Profile() if profile else None
    fleet0, cpu0 = drive.fleet_cpu, time.thread_time()
    if prof:
        prof.enable()
    await drive.until(end)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    cpu = time.thread_time() - cpu0 - (drive.fleet_cpu - fleet0)
    n, steps = sum(svc.received.values()) - got0, svc.core.next_step - step0
    return {
        "value": cpu / steps * 1e3,
        "steps": steps,
        "messages": n,
        "service_cpu_s": cpu,
        "messages_per_service_cpu_s": n / cpu,
        "samples_trained": svc.core.ledger.n_trained - trained0,
        "received_total": dict(svc.received),  # the whole run, warm-up and registration included
        "fleet_errors": drive.fleet.errors[:5],
        "profiled": bool(prof),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--heartbeats", type=float, default=None, help="heartbeats per step (default: the mix's)")
    ap.add_argument("--rollouts", type=int, default=0, help="rollout workers (default: the config's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="a cProfile of the measured steps, to PATH")
    args = ap.parse_args(argv)
    mix = DEFAULT_MIX if args.heartbeats is None else dataclasses.replace(DEFAULT_MIX, heartbeats=args.heartbeats)
    load0 = os.getloadavg()[0]
    m = asyncio.run(measure(mix, args.steps, args.warmup, args.profile, args.rollouts))
    row = {"metric": "scheduler_service_cpu_ms_per_step", "unit": "ms", **m, "mix": dataclasses.asdict(mix)}
    row.update(loadavg_before=load0, loadavg_after=os.getloadavg()[0], cpu_count=os.cpu_count())
    print(
        f"{row['metric']} {row['value']:.3f} ms: {m['steps']} steps, {m['messages']} messages, "
        f"{m['messages_per_service_cpu_s']:.0f} per service CPU-s, {m['rollouts']} rollout workers"
        f"{' (profiled)' if args.profile else ''}; "
        f"load {load0:.2f} -> {row['loadavg_after']:.2f}"
    )
    if args.json:
        write_rows(args.json, [row])
    return [row]


if __name__ == "__main__":
    main()
