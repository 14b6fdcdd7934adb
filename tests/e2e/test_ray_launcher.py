"""cluster.launcher=ray with a real local Ray (``pip install -e '.[ray]'``; skipped without it): the
tiny fleet runs with every worker held by a Ray actor in the run's placement group, a worker
process killed mid-run is restarted like a local one, and the books stay exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from areal_async.supervisor.ray_launcher import bundle_addresses, bundles_of
from tests.support.admission_gate import admission_gate
from tests.support.fleet import ROOT, check_books, cli, finish_ok, wait_for_metrics


def test_bundles_give_each_worker_a_cpu_and_its_gpus():
    assert bundles_of(["scheduler", "rollout-0", "trainer"], {"rollout-0": 2, "trainer": 1, "scheduler": 0}) == [
        {"CPU": 1.0},
        {"CPU": 1.0, "GPU": 2.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]


def test_a_multi_node_run_binds_on_the_node_ray_put_each_bundle_on():
    # the shapes of ray.util.placement_group_table(pg) and ray.nodes() (ray/_private/state.py, ray 2.60)
    table = {"bundles_to_node_id": {0: "aa", 1: "bb", 2: "aa"}}
    nodes = [
        {"NodeID": "aa", "NodeManagerAddress": "10.0.0.1", "Alive": True},
        {"NodeID": "bb", "NodeManagerAddress": "10.0.0.2", "Alive": True},
    ]
    got = bundle_addresses(table, nodes, ["scheduler", "trainer", "rollout-0"])
    assert got == {"scheduler": "10.0.0.1", "trainer": "10.0.0.2", "rollout-0": "10.0.0.1"}


REAP = """
import os, subprocess, sys, time
from areal_async.supervisor.ray_launcher import _become_subreaper, _descendants, _reap
keep = subprocess.Popen(["sleep", "60"])  # a child from before the local Ray: spared
spare = _descendants(os.getpid())
_become_subreaper()
subprocess.run(["bash", "-c", "(sleep 60 &); exit 0"])  # a process that leaves an orphan behind, as raylet may
orphan = [p for p in _descendants(os.getpid()) if p[0] != keep.pid]
_reap(set(), 1.0, spare=spare)
print(len(orphan), os.path.exists(f"/proc/{orphan[0][0]}") and open(f"/proc/{orphan[0][0]}/stat").read().split()[2],
      keep.poll())
keep.kill()
"""


def test_close_reaps_the_local_rays_orphans_and_spares_older_children():
    out = subprocess.run([sys.executable, "-c", REAP], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    n, orphan_state, keep = out.stdout.split()
    assert n == "1"  # the orphan came to this process (subreaper), not to init
    assert orphan_state in ("False", "Z") and keep == "None"  # killed and reaped; the older child still runs


@pytest.mark.slow
def test_tiny_fleet_on_a_local_ray_restarts_a_killed_worker(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    steps = 80
    # the fleet trains at most 5 steps until the restarted rollout-1 has registered again (the test then
    # opens the gate), so a fast fleet cannot finish the run on rollout-0 alone before the restart
    gate = admission_gate(tmp_path, steps=5)
    proc = subprocess.Popen(
        cli(run_dir, f"total_train_steps={steps}", "cluster.launcher=ray"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gate.env,
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
    sched_log = run_dir / "logs" / "scheduler.log"
    deadline = time.monotonic() + 300
    while sched_log.read_text().count("registered rollout rollout-1") < 2:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the restarted rollout-1 did not register again within 300 s"
        time.sleep(0.2)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) <= 5  # the gate held the fleet
    gate.open()
    err = finish_ok(proc, timeout=600)
    assert "worker rollout-1" in err and "restarting it (1/2)" in err
    new = json.loads((run_dir / "pids.json").read_text())
    assert new["rollout-1"] != pids["rollout-1"]
    check_books(run_dir, eta=1, steps=steps)  # the local launcher's run-directory checks
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == 1
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert log.count("registered rollout rollout-1") == 2  # the restarted process was admitted again
