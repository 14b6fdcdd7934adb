"""The hang capture and the doctor on a real fleet: a SIGSTOPped trainer, the step watchdog, every
worker's stacks in the run directory, and `areal-async doctor` naming the stopped trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.fleet import ROOT
from tests.support.procs import alive
from tests.e2e.test_e2e_liveness import start, wait_steps

pytestmark = pytest.mark.slow


def test_a_stopped_trainer_is_captured_by_the_watchdog_and_named_by_the_doctor(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(
        run_dir,
        "total_train_steps=200",
        "cluster.step_timeout_s=12",
        "cluster.worker_timeout_s=120",  # the watchdog acts, not the heartbeat timeout
        "recover.retries=0",
    )
    wait_steps(run_dir, proc, 2)
    trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
    os.kill(trainer, signal.SIGSTOP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "no trainer step for" in err
    assert "stacks of reward-0, rollout-0, rollout-1, scheduler, trainer captured" in err
    assert not alive(trainer)
    (cap,) = [json.loads(x) for x in (run_dir / "hangs.jsonl").read_text().splitlines()]
    assert cap["workers"]["trainer"]["state"] == "T" and cap["workers"]["trainer"]["dumped"]
    assert all(w["dumped"] and w["bytes"] > 0 for w in cap["workers"].values())
    assert "workers/trainer.py" in (run_dir / "stacks" / "trainer.txt").read_text()

    doc = subprocess.run(
        [sys.executable, "-m", "areal_async.cli", "doctor", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert doc.returncode == 1, doc.stderr
    (hang,) = [f for f in json.loads(doc.stdout)["findings"] if f["code"] == "hang"]
    assert f"trainer (pid {trainer}): process state STOPPED (by a signal); stacks dumped" in hang["evidence"]
    assert "resume it with SIGCONT" in hang["advice"] and "workers/trainer.py" in hang["stacks"]["trainer"]
