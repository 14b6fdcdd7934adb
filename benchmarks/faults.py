"""Fault injection: a run with K SIGKILLs at seeded random moments across every role of its fleet.

    python -m benchmarks.faults [--config CONFIG] [key=value ...] --kills 10 --json faults.json
                                [--seed 1] [--steps 60] [--retries 3]

Runs CONFIG (default the tiny preset; small batches, checkpoints every 2 steps; ``key=value``
overrides on top, e.g. ``cluster.n_trainer_ranks=2``, ``rollout.backend=sglang``) twice with the
same config: once fault-free, once with K kills. Kill k waits until the run's books show a seeded
random trainer step (spaced at least 3 steps apart, so a checkpoint lands between two kills), waits
a random 0-1 s more, then SIGKILLs one process of a seeded random role of that fleet (rollout,
reward, trainer, scheduler; the inference servers of an sglang/vllm backend; the bring-your-own
reward workers, ``external``; a random process when a role has several, a follower trainer rank
included). The seed fixes the kill points and the role draw over the roles the fleet has, so the
same seed gives the same kills on every preset with the same roles. Rollout/reward/server deaths
are restarted by the supervisor (``cluster.max_restarts``); trainer/scheduler deaths are recovered
in-run from the newest complete checkpoint (``recover.retries``, counted in a row without
progress). External reward workers (``cluster.n_external_reward_workers``) are started and, when
killed or when the fleet is relaunched, started again by this benchmark as their owner would,
under a new worker id each time.

Reported (JSON rows, ``metric``/``value``/``unit``): completed (1/0), kills by role, worker
restarts, fleet recoveries, samples re-issued, ``samples_lost``, ids trained twice (must be 0),
steps whose trained sample count is not exactly batch x n (must be 0), the disagreements
``areal-async verify`` finds between the scheduler's books, the trainer's record and the
rollouts' records (must be 0; ``areal_async.app.commands.verify``), and the wall-time overhead of the
faulty run over the fault-free one (a ratio). Ids trained twice and bad steps are counted from the
trainer's own record (the books' counts ride along as ``books_*``: a scheduler cannot vouch for
itself). On a shared machine the ratio moves with other load; ``loadavg_before`` is in every row.
The exit code is 0 only when the faulty run completed and both runs verify clean.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from areal_async.api import run_command
from areal_async.app.commands.verify import Report, verify_run
from areal_async.config import load_config
from benchmarks.common.cpu import count_lines
from benchmarks.common.fleet import stop
from benchmarks.common.rows import Col, print_table, write_rows

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("rollout", "reward", "trainer", "scheduler")
B, N = 4, 4  # the defaults of batch size and samples per prompt (a run's own come from its config)


def overrides(steps: int, kills: int, retries: int) -> list[str]:
    return [
        f"total_train_steps={steps}",
        "sft_warmup.steps=10",
        f"train_dataset.batch_size={B}",
        f"gconfig.n_samples={N}",
        "rollout.max_head_offpolicyness=1",
        "cluster.heartbeat_s=0.5",
        "cluster.worker_timeout_s=10",
        "cluster.step_timeout_s=60",
        f"cluster.max_restarts={kills}",
        "saver.freq_steps=2",
        "saver.keep_last=2",
        f"recover.retries={retries}",
        "reward.deadline_s=20",
        "rollout.gen_deadline_s=60",
    ]


def kill_plan(seed: int, kills: int, steps: int, roles: tuple[str, ...] = ROLES) -> list[tuple[int, float, str]]:
    """(trainer step to wait for, extra delay in s, role) per kill, in order."""
    rng = random.Random(seed)
    points = list(range(2, steps - 2, 3))
    if kills > len(points):
        raise ValueError(f"--kills {kills}: a {steps}-step run has room for at most {len(points)} kills 3 steps apart")
    return [(t, rng.uniform(0.0, 1.0), rng.choice(roles)) for t in sorted(rng.sample(points, kills))]


def fleet_roles(cfg) -> tuple[str, ...]:
    """The roles of ``cfg``'s fleet that a kill may hit: processes of that name prefix in pids.json,
    or ``external`` for the bring-your-own reward workers this benchmark runs."""
    roles = [r for r in ROLES if r != "reward" or cfg.cluster.n_reward_workers]  # ROLES' order: the same draws
    backend = cfg.rollout.backend.split(":")[0]
    roles += [backend] if backend in ("sglang", "vllm") and not getattr(cfg, backend).addresses else []
    roles += ["external"] if cfg.cluster.n_external_reward_workers else []
    return tuple(roles)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def victim(run_dir: Path, role: str, rng: random.Random, proc: subprocess.Popen, timeout_s: float = 60.0):
    """(worker id, pid) of a live process of `role`, waiting for one (a fleet may be relaunching)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            pids = json.loads((run_dir / "pids.json").read_text())
        except (OSError, json.JSONDecodeError):
            pids = {}
        live = sorted((w, p) for w, p in pids.items() if w.split("-")[0] == role and alive(p))
        if live:
            return rng.choice(live)
        time.sleep(0.2)
    return None


def start(run_dir: Path, ovr: list[str], log: Path, config: str) -> subprocess.Popen:
    cmd = run_command(config, run_dir, ovr)
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
        )


def inject(proc: subprocess.Popen, run_dir: Path, plan: list, seed: int, ext: "Externals") -> list[dict]:
    rng, done = random.Random(seed + 1), []
    for step, delay, role in plan:
        while count_lines(run_dir / "metrics.jsonl") < step and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(delay)
        got = ext.victim(rng, proc) if role == "external" else victim(run_dir, role, rng, proc)
        if proc.poll() is not None or got is None:
            break
        wid, pid = got
        os.kill(pid, signal.SIGKILL)
        done.append({"role": role, "worker": wid, "pid": pid, "after_step": count_lines(run_dir / "metrics.jsonl")})
        print(f"  kill {len(done)}: {wid} (pid {pid}) after {done[-1]['after_step']} steps", flush=True)
    return done


def run(run_dir: Path, ovr: list[str], plan: list, seed: int, timeout_s: float, cfg, config: str) -> dict:
    t0 = time.monotonic()
    proc = start(run_dir, ovr, run_dir.with_suffix(".log"), config)
    ext = Externals(run_dir, cfg.cluster.n_external_reward_workers, proc)
    try:
        kills = inject(proc, run_dir, plan, seed, ext)
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    except BaseException:
        stop(proc)
        raise
    finally:
        ext.close()
    return {"rc": rc, "wall_s": time.monotonic() - t0, "kills": kills, "external_starts": ext.starts}


class Externals:
    """The fleet's bring-your-own reward workers (``workers.external_reward``), kept running as their
    owner would: started once the run's endpoints exist, and again (a new worker id) when one died (not
    exit 0: the run ended) or the supervisor relaunched the fleet (new endpoints: new keys). A thread;
    ``close`` stops them."""

    def __init__(self, run_dir: Path, n: int, fleet: subprocess.Popen):
        self.run_dir, self.n, self.fleet, self.starts = run_dir, n, fleet, 0
        self.procs: dict[int, subprocess.Popen] = {}
        self._stamp: Optional[float] = None  # endpoints.json's mtime when they were started
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._keep, name="externals", daemon=True)
        if n:
            self._thread.start()

    def _keep(self) -> None:
        while not self._stop.wait(0.3) and self.fleet.poll() is None:
            try:
                stamp = (self.run_dir / "endpoints.json").stat().st_mtime
            except OSError:
                continue
            with self._lock:
                for slot in range(self.n):
                    p = self.procs.get(slot)
                    if p is None or p.poll() not in (None, 0) or stamp != self._stamp:  # 0: told the run ended
                        self._start(slot, p)
                self._stamp = stamp

    def _start(self, slot: int, old: Optional[subprocess.Popen]) -> None:
        if old is not None and old.poll() is None:
            old.kill()  # of the previous fleet: its endpoints are gone
            old.wait(timeout=10)
        wid = f"ext{slot}-{self.starts}"
        self.starts += 1
        cmd = [sys.executable, "-m", "workers.external_reward", str(self.run_dir), "--slot", str(slot)]
        with open(self.run_dir / f"{wid}.log", "wb") as log:
            self.procs[slot] = subprocess.Popen(
                [*cmd, "--worker-id", wid], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def victim(self, rng: random.Random, fleet: subprocess.Popen, timeout_s: float = 60.0):
        """(worker id, pid) of a live external worker, waiting for one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and fleet.poll() is None:
            with self._lock:
                live = sorted((p.args[-1], p.pid) for p in self.procs.values() if p.poll() is None)
            if live:
                return rng.choice(live)
            time.sleep(0.2)
        return None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def verify_row(rep: Report) -> dict:
    """``areal-async verify``'s verdict as row fields: its counts, its disagreements by kind, the first lines,
    and per start that cut the books (resumes.json) what it rolled back and how many samples it excused."""
    return {
        "counts": rep.counts,
        "kinds": dict(rep.kinds()),
        "problems": rep.lines(10),
        "summary": rep.summary(),
        "rollbacks": rep.rollback_lines(),
    }


def books(run_dir: Path, steps: int, per_step_samples: int = B * N) -> dict:
    """What the scheduler's books say: summary counts, ids trained twice, steps with a wrong count."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    lines = (
        [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines() if x.strip()]
        if (run_dir / "trajectories.jsonl").exists()
        else []
    )
    trained = Counter(t["id"] for t in lines if t["status"] == "trained")
    per_step = Counter(t["train_step"] for t in lines if t["status"] == "trained")
    return {
        "summary": summary,
        "ids_trained_twice": sum(1 for c in trained.values() if c > 1),
        "bad_steps": sum(1 for s in range(steps) if per_step.get(s, 0) != per_step_samples),
        "ids_repeated": len(lines) - len({t["id"] for t in lines}),
    }


def measure(args) -> list[dict]:
    ovr = overrides(args.steps, args.kills, args.retries) + list(args.overrides)
    cfg = load_config(args.config, ovr)  # refuses a bad override before anything runs
    per_step = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    plan = kill_plan(args.seed, args.kills, args.steps, fleet_roles(cfg))
    root = Path(args.run_root or tempfile.mkdtemp(prefix="faults-"))
    root.mkdir(parents=True, exist_ok=True)
    load, cpu0 = os.getloadavg()[0], os.times()
    print(f"fault-free run ({args.steps} steps) of {args.config} {args.overrides} in {root}/clean", flush=True)
    clean = run(root / "clean", ovr, [], args.seed, args.timeout_s, cfg, args.config)
    print(f"faulty run: {args.kills} kills planned: {[(s, r) for s, _, r in plan]}", flush=True)
    faulty = run(root / "faulty", ovr, plan, args.seed, args.timeout_s, cfg, args.config)
    b = books(root / "faulty", args.steps, per_step)
    s = b["summary"]
    completed = int(faulty["rc"] == 0 and s.get("steps") == args.steps)
    rep, rep_clean = verify_run(root / "faulty"), verify_run(root / "clean")
    trained = rep.trained_per_step
    bad_steps = sum(1 for k in range(args.steps) if trained.get(k, 0) != per_step)
    cpu1 = os.times()
    common = {
        "config": args.config,
        "overrides": list(args.overrides),
        "seed": args.seed,
        "kills_planned": args.kills,
        "steps": args.steps,
        "retries": args.retries,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg()[0],
        "children_cpu_s": round(
            cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system, 1
        ),
        "run_dir": str(root / "faulty"),
    }
    by_role = dict(Counter(k["role"] for k in faulty["kills"]))

    def row(metric, value, unit, **kw):
        return {"metric": metric, "value": value, "unit": unit, **common, **kw}

    return [
        row("faults_completed", completed, "bool", exit_code=faulty["rc"]),
        row("faults_kills", len(faulty["kills"]), "kills", by_role=by_role, kills=faulty["kills"]),
        row("faults_restarts", s.get("restarts"), "restarts"),
        row("faults_recoveries", s.get("recoveries"), "recoveries"),
        row(
            "faults_samples_reissued",
            s.get("samples_reissued"),
            "samples",
            prompts_reissued=s.get("prompts_reissued"),
            prompts_dropped=s.get("prompts_dropped"),
        ),
        row("faults_samples_lost", s.get("samples_lost"), "samples"),
        row(
            "faults_ids_trained_twice",
            rep.kinds()["trained_twice"],
            "ids",
            source="trainer_steps.jsonl",
            books_ids_trained_twice=b["ids_trained_twice"],
            books_ids_repeated=b["ids_repeated"],
        ),
        row(
            "faults_bad_steps",
            bad_steps,
            "steps",
            note=f"steps whose trained samples != {per_step} in the trainer's record",
            books_bad_steps=b["bad_steps"],
        ),
        row("faults_verify_disagreements", len(rep.problems), "problems", **verify_row(rep)),
        row("faults_verify_clean_run", len(rep_clean.problems), "problems", **verify_row(rep_clean)),
        row(
            "faults_wall_overhead",
            faulty["wall_s"] / clean["wall_s"] if clean["rc"] == 0 else None,
            "ratio",
            clean_wall_s=clean["wall_s"],
            faulty_wall_s=faulty["wall_s"],
            clean_exit_code=clean["rc"],
            external_starts=faulty["external_starts"],
        ),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.faults", description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides, after the benchmark's own")
    p.add_argument("--config", default=str(ROOT / "configs/tiny_arith.yaml"), help="the preset to run")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="total_train_steps of both runs")
    p.add_argument("--retries", type=int, default=3, help="recover.retries")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--run-root", default="", help="where the two run dirs go (default: a new temp dir)")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    rows = measure(args)
    print_table(
        rows,
        [
            Col("metric", 26, lambda r: r["metric"], left=True),
            Col("value", 10, lambda r: r["value"]),
            Col("unit", 11, lambda r: r["unit"], left=True),
        ],
    )
    if args.json:
        write_rows(args.json, rows)
    for r in rows:
        if r["metric"].startswith("faults_verify"):
            print(f"{r['metric']}: {r['summary']}")
            print("".join(f"  {x}\n" for x in r["problems"] + [f"rolled back: {x}" for x in r["rollbacks"]]), end="")
    verified = all(r["value"] == 0 for r in rows if r["metric"].startswith("faults_verify"))
    return 0 if rows[0]["value"] == 1 and verified else 1


if __name__ == "__main__":
    sys.exit(main())
