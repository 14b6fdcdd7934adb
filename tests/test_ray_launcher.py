"""cluster.launcher=ray with a real local Ray (``pip install -e '.[ray]'``; skipped without it): the
tiny fleet runs with every worker held by a Ray actor in the run's placement group, a worker
process killed mid-run is restarted like a local one, and the books stay exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from areal_async.supervisor.ray_launcher import bundles_of
from tests.test_e2e import ROOT, cli, finish_ok, read_jsonl, wait_for_metrics


def test_bundles_give_each_worker_a_cpu_and_its_gpus():
    assert bundles_of(["scheduler", "rollout-0", "trainer"], {"rollout-0": 2, "trainer": 1, "scheduler": 0}) == [
        {"CPU": 1.0},
        {"CPU": 1.0, "GPU": 2.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]


@pytest.mark.slow
def test_tiny_fleet_on_a_local_ray_restarts_a_killed_worker(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    steps = 60
    proc = subprocess.Popen(
        cli(run_dir, f"total_train_steps={steps}", "cluster.launcher=ray"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_metrics(run_dir, proc, timeout=500)
    pids = json.loads((run_dir / "pids.json").read_text())
    # the worker runs under a Ray actor: its parent is a Ray worker process, not the supervisor
    with open(f"/proc/{pids['rollout-1']}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    assert parent != proc.pid
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        assert b"ray" in f.read().lower()
    os.kill(pids["rollout-1"], signal.SIGKILL)
    err = finish_ok(proc, timeout=600)
    assert "worker rollout-1" in err and "restarting it (1/2)" in err
    new = json.loads((run_dir / "pids.json").read_text())
    assert new["rollout-1"] != pids["rollout-1"]
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"] and summary["samples_lost"] == 0
    assert sum(t["status"] == "trained" for t in trajs) == summary["samples_trained"] == steps * 4 * 4
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["staleness_max"] <= 1 for m in metrics)
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert log.count("registered rollout rollout-1") == 2  # the restarted process was admitted again
