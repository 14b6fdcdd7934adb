"""End-to-end over the TCP control plane with CURVE: the tiny fleet over two loopback "nodes" (127.0.0.1,
127.0.0.2) with every socket on tcp:// (control, reward queues, trajectory and weight tensors over zmq) and the
kernel's view of its sockets; and a gloo fleet of two trainer ranks on tcp://, keys 0600, every binder behind
CURVE, no listener on a wildcard address; exact books in both.
(A restart's admission with the same launch token: tests/unit/base/test_cluster_security.py.)"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time

import pytest
from tests.support.fleet import ROOT, check_books, cli, finish_ok, wait_for
from tests.support.procs import listeners, tcp_sockets


pytestmark = pytest.mark.slow

TCP = ["cluster.control=tcp", "tensor_channel.trajectories=zmq", "tensor_channel.weights=zmq"]


# ---- two loopback nodes -----------------------------------------------------------------------
NODE = {0: "127.0.0.1", 1: "127.0.0.2"}
TWO_NODES = [
    *TCP,
    "cluster.n_nodes=2",
    "cluster.node_hosts=['127.0.0.1','127.0.0.2']",
    "cluster.n_reward_workers=0",  # the test's own reward worker (below) scores: the fleet waits for it
    "cluster.n_external_reward_workers=1",
]


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_fleet_across_two_loopback_nodes(tmp_path):
    """cluster.n_nodes=2 on 127.0.0.1 and 127.0.0.2: the processes are dealt over the nodes (scheduler 0,
    trainer 1, rollout-0 0, rollout-1 1), every endpoint is advertised with its binder's node address,
    and the kernel shows each process's sockets bound and connected on its own node's address (no
    0.0.0.0, no fallback to 127.0.0.1 on node 1); the run over CURVE keeps exact books."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli(run_dir, *TWO_NODES), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: (run_dir / "pids.json").exists() and (run_dir / "endpoints.json").exists(), 120, "the fleet")
        pids = json.loads((run_dir / "pids.json").read_text())
        ep = json.loads((run_dir / "endpoints.json").read_text())
        nodes = {w: s["node"] for w, s in pids["placement"].items()}
        assert nodes == {"scheduler": 0, "trainer": 1, "rollout-0": 0, "rollout-1": 1}
        assert ep["control"].startswith("tcp://127.0.0.1:") and ep["rewards"][0].startswith("tcp://127.0.0.1:")
        assert ep["trajectories"].startswith("tcp://127.0.0.2:")
        assert ep["weights_endpoint"].startswith("tcp://127.0.0.2:")
        control, traj = _port(ep["control"]), _port(ep["trajectories"])

        def linked() -> bool:  # node 1 reached node 0's scheduler; node 0's rollout reached node 1's trainer
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            socks = {w: tcp_sockets(pids[w]) for w in nodes}
            return (
                any(s[:2] == ("127.0.0.2", traj) and s[4] == "0A" for s in socks["trainer"])
                and all(any(s[2:] == ("127.0.0.1", control, "01") for s in socks[w]) for w in ("trainer", "rollout-1"))
                and any(s[2:] == ("127.0.0.2", traj, "01") for s in socks["rollout-0"])
            )

        wait_for(linked, 240, "connections across the two nodes")
        for w, node in nodes.items():
            socks = tcp_sockets(pids[w])
            assert socks and {s[0] for s in socks} == {NODE[node]}, (w, socks)
        # only now may the fleet score: the test's reward worker (on node 0) joins
        with open(tmp_path / "ext.log", "wb") as log:
            scorer = subprocess.Popen(
                [sys.executable, "-m", "workers.external_reward", str(run_dir)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            finish_ok(proc, timeout=300)
            assert scorer.wait(timeout=60) == 0
        finally:
            if scorer.poll() is None:
                scorer.kill()
                scorer.wait()
    finally:
        if proc.poll() is None:  # a failed check: the supervisor stops every worker it started on SIGTERM
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=120)
    check_books(run_dir, eta=1)
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert "refused a registration" not in log
    assert all(f"registered {w.split('-')[0]} {w} " in log for w in nodes if w != "scheduler")


# ---- no open door: every listener of a gloo fleet on the node's address --------------------------
GLOO_RANKS = [
    "cluster.control=tcp",
    "tensor_channel.trajectories=gloo",
    "tensor_channel.weights=gloo",
    "tensor_channel.bucket_mb=0.0625",
    "cluster.n_trainer_ranks=2",
    "rollout.max_head_offpolicyness=2",
]


def test_gloo_fleet_with_two_trainer_ranks_listens_on_no_wildcard(tmp_path):
    """torch's TCPStore listened on '*' for the trajectory group and the trainer ranks (seen with ss on the
    code before): now each group's store is served by the trainer over the run's CURVE sockets on the node's
    address, and gloo's pairs bind it too. Every listening socket of every process of the run, sampled from
    /proc while it runs, is on 127.0.0.1; the books are exact.
    The same run is the fleet on the TCP control plane with CURVE (keys 0600, every binder's ZAP handler, each
    worker registered over it) and on gloo for both tensor channels: trajectories, and weights gathered from the
    two ranks' shards in buckets of 64 KiB to every rollout worker. (These were two more fleets; the zmq tensor
    channel over tcp:// is the two-node test's.)"""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli(run_dir, *GLOO_RANKS), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: set[tuple[str, int]] = set()
    try:
        wait_for(lambda: (run_dir / "pids.json").exists(), 120, "the fleet")
        pids = {w: p for w, p in json.loads((run_dir / "pids.json").read_text()).items() if isinstance(p, int)}
        while proc.poll() is None:
            for pid in pids.values():
                try:
                    seen |= set(listeners(pid))
                except OSError:
                    pass  # exited between the listing and the read
            time.sleep(0.2)
        finish_ok(proc, timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=120)
    manifest = json.loads((run_dir / "endpoints.json").read_text())
    stores = {manifest[k] for k in ("traj_store", "weight_store", "trainer_store")}
    assert all(s.startswith("tcp://127.0.0.1:") for s in stores) and len(stores) == 3, stores
    assert {("127.0.0.1", _port(manifest["traj_store"])), ("127.0.0.1", _port(manifest["trainer_store"]))} <= seen
    assert seen and {ip for ip, _ in seen} == {"127.0.0.1"}, sorted(seen)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700  # checkpoints in it are unpickled on resume
    check_books(run_dir, eta=2)
    assert all(manifest[k].startswith("tcp://") for k in ("control", "trajectories", "weights_endpoint"))
    assert manifest["rewards"] and all(e.startswith("tcp://") for e in manifest["rewards"])
    for name in ("server.key", "client.key", "roster.json"):
        assert stat.S_IMODE((run_dir / "keys" / name).stat().st_mode) == 0o600
    logs = {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    for wid in ("reward-0", "rollout-0", "rollout-1", "trainer"):
        assert f"registered {wid.split('-')[0]} {wid} " in logs["scheduler"]
    assert "refused a registration" not in logs["scheduler"]
    assert "admitted a CURVE connection from 127.0.0.1 (client key of " in logs["scheduler"]  # peer addresses seen
    # every binding process ran a ZAP handler with the run's allow list
    assert all("CURVE on" in logs[w] for w in ("scheduler", "reward-0", "trainer")), sorted(logs)
    for r in range(2):  # every rollout worker loaded the last published version over gloo
        assert "exiting with code 0" in logs[f"rollout-{r}"]
    assert json.loads((run_dir / "summary.json").read_text())["version"] == 6
