"""``areal-async status`` on a live tiny run: the scheduler answers a StatusRequest over the control
plane (no logs read); asked twice, the versions have advanced; a run stopped by SIGTERM (exit 143) is reported as gone.
The run is far longer than the test; the test stops it, so a fast machine cannot finish it between the queries."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async.api import run_command
from areal_async.app.commands.status import StatusError, query_status, render
from protocols import messages as M
from tests.support.fleet import wait_registered

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 100_000  # far more than the test lets it run: it stops the run itself (SIGTERM) after its queries
ARGS = [
    f"total_train_steps={TOTAL_STEPS}",
    "sft_warmup.steps=10",
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "cluster.heartbeat_s=0.5",
    "rollout.max_head_offpolicyness=1",
]


def step_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"kind"' not in line) if path.exists() else 0


def wait_for_steps(proc, run_dir: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while step_rows(run_dir) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout}s"
        time.sleep(0.1)


def test_status_of_a_live_run_shows_every_worker_and_advancing_versions(tmp_path):
    run_dir = tmp_path / "run"
    cmd = run_command(ROOT / "configs/tiny_arith.yaml", run_dir, ARGS)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(proc, run_dir, 3)
        pids = json.loads((run_dir / "pids.json").read_text())
        wait_registered(run_dir, proc, [k for k in pids if k.startswith(("trainer", "rollout", "reward"))])
        first = query_status(run_dir, timeout_s=20)
        cli = subprocess.run(
            [sys.executable, "-m", "areal_async.cli", "status", str(run_dir), "--timeout", "20"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        wait_for_steps(proc, run_dir, first.next_step + 5)
        second = query_status(run_dir, timeout_s=20)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # final checkpoint, then exit 143
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    pids = json.loads((run_dir / "pids.json").read_text())
    for r in (first, second):
        assert isinstance(r, M.StatusReport) and not r.finished
        assert {w["worker_id"]: w["pid"] for w in r.workers} == {
            k: v for k, v in pids.items() if k.startswith(("trainer", "rollout", "reward"))
        }
        assert {w["role"] for w in r.workers} == {"trainer", "rollout", "reward"}
        assert all(
            # "silent": no heartbeat for 2 heartbeat_s at that instant (a loaded runner), not lost: never restarted
            w["host"] == socket.gethostname() and w["state"] in ("alive", "silent") and w["restarts"] == 0
            for w in r.workers
        )
        assert r.admitted >= r.running >= 0 and r.samples_trained == 16 * r.next_step and r.total_steps == TOTAL_STEPS
        # the groups out on each rollout worker add up to the groups running; no other role holds one
        assert sum(w["groups"] for w in r.workers if w["role"] == "rollout") == r.running
        assert all(w["groups"] == 0 for w in r.workers if w["role"] != "rollout")
    assert second.version >= first.version + 5 and second.next_step >= first.next_step + 5
    t1, t2 = (next(w for w in r.workers if w["role"] == "trainer") for r in (first, second))
    assert t2["version"] == second.version > t1["version"] and t2["samples"] > t1["samples"] > 0
    # a rollout worker's loaded version is one the trainer published (never ahead of it; -1: none loaded yet); how far
    # behind it is at one instant is timing, not an invariant (CI saw more than 2 behind once the trainer ran on
    # oneDNN; the staleness bound holds for the trained samples, which `verify` checks in the tests that end their
    # runs): beyond that, only that the versions advance is asserted
    for r in (first, second):
        assert all(-1 <= w["version"] <= r.version for w in r.workers if w["role"] == "rollout")
    assert max(w["version"] for w in second.workers if w["role"] == "rollout") > max(
        w["version"] for w in first.workers if w["role"] == "rollout"
    )
    assert cli.returncode == 0, cli.stderr
    assert "groups: admitted" in cli.stdout and "rollout-1" in cli.stdout
    assert cli.stdout.count(" alive ") + cli.stdout.count(" silent ") == 4
    for r in (first, second):  # a healthy run: the oldest open work is held by a worker, named with its role
        assert r.overdue.split(" (")[0] in ("rollout", "reward", "trainer"), r.overdue
    assert "oldest unfinished work: " in cli.stdout
    with pytest.raises(StatusError, match="no status from the scheduler at .* within 1s"):
        query_status(run_dir, timeout_s=1.0)  # the run is over
    assert "samples/s" in render(second)


def test_status_without_a_run_is_refused_clearly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "areal_async.cli", "status", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and f"{tmp_path / 'endpoints.json'} does not exist" in done.stderr
    assert not os.listdir(tmp_path)
