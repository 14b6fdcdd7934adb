"""Running a tiny fleet from a test and checking what it leaves: the command (``areal_async.api.run_command``,
the one builder tests and benchmarks share), the short-run overrides, waiting for it to finish cleanly, and its
books checked against the invariants (staleness bound, exactly-once accounting, ``areal-async verify``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from areal_async.api import run_command
from areal_async.app.commands.verify import verify_run
from tests.support.procs import descendants, survivors

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_arith.yaml"
FAST = [
    "total_train_steps=6",
    "sft_warmup.steps=10",
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "cluster.heartbeat_s=0.5",
]


def cli(run_dir: Path, *overrides: str) -> list[str]:
    """``areal-async run configs/tiny_arith.yaml`` in ``run_dir``, short (``FAST``), then ``overrides``."""
    return run_command(TINY, run_dir, [*FAST, *overrides])


def run_ok(run_dir: Path, *overrides: str, timeout: float = 240) -> None:
    """Run to completion; every process the run started (workers and their own children, such
    as reward-checking processes) must be gone shortly after the supervisor exits."""
    proc = subprocess.Popen(
        cli(run_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    finish_ok(proc, timeout)


def finish_ok(proc: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for a started run to exit 0 and leave no process behind; returns its stderr."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        seen |= descendants(proc.pid)
        if time.monotonic() >= deadline:
            stop(proc)
            raise AssertionError("run did not finish in time")
        time.sleep(0.3)
    out, err = proc.communicate()
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    assert survivors(seen, within_s=1.0) == [], "processes outlived the run"
    return err


def wait_for_metrics(run_dir: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if time.monotonic() >= deadline:
            stop(proc)
            raise AssertionError("no trainer step within the deadline")
        time.sleep(0.2)


def wait_registered(run_dir: Path, proc: subprocess.Popen, names, times: int = 1, timeout: float = 150) -> None:
    """Until the scheduler's log names each worker of ``names`` as registered ``times`` times (a restarted one
    registers again), the run ``proc`` still running; past ``timeout`` the run is stopped and the test fails. A worker
    can start after the fleet's first steps (the others make them): a test that acts on one, or expects it in a
    status, waits for it here (CI saw rollout-1 register 0.5 s and four steps after rollout-0)."""
    log = run_dir / "logs" / "scheduler.log"

    def all_registered() -> bool:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        text = log.read_text() if log.exists() else ""
        return all(len(re.findall(rf"registered \S+ {re.escape(n)} \(pid ", text)) >= times for n in names)

    try:
        wait_for(all_registered, timeout, f"{list(names)} registered {times} time(s)")
    except AssertionError:
        if proc.poll() is None:
            stop(proc)
        raise


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a run a test gave up on, so that a failing test leaves no fleet behind: SIGTERM to its
    supervisor (which stops every process it started); SIGKILL to it and what it started after ``grace_s``."""
    proc.terminate()
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:  # still under it now: its own, no reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_books(run_dir: Path, eta: int, steps: int = 6) -> list[dict]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert {"step", "version", "reward_mean", "staleness_max", "samples_trained", "wall_s"} <= set(m)
        assert m["version"] == m["step"] + 1 and 0 <= m["reward_mean"] <= 1 and m["staleness_max"] <= eta
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"]  # every sample appears exactly once
    assert summary["samples_lost"] == 0 and summary["steps"] == steps
    trained = [t for t in trajs if t["status"] == "trained"]
    assert len(trained) == summary["samples_trained"] == steps * 4 * 4
    assert all(t["status"] == "aborted" and t["reason"] for t in trajs if t["status"] != "trained")
    for t in trained:
        assert t["version_min"] >= t["train_step"] - eta, t
        assert t["version_min"] <= t["version_max"] <= t["train_step"], t
    assert_verified(run_dir, steps)
    return trained


def assert_verified(run_dir: Path, steps: int) -> None:
    """The books agree with the trainer's record and the rollouts' (``areal-async verify``)."""
    rep = verify_run(run_dir)
    assert rep.ok, "\n".join(rep.lines(20))
    assert rep.counts["steps"] == steps and rep.counts["trained"] == rep.counts["booked_trained"] == steps * 4 * 4


def leaked_segments(run_dir: Path) -> list[str]:
    run_id = json.loads((run_dir / "endpoints.json").read_text())["run_id"]
    return [p.name for p in Path("/dev/shm").glob(f"areal_{run_id}_*")]
