"""End-to-end over the TCP control plane with CURVE: the tiny fleet with every socket on tcp://
(control, reward queues, trajectory and weight tensors over zmq), keys 0600, exact books.
(A restart's admission with the same launch token: tests/test_cluster_security.py.)"""

from __future__ import annotations

import json
import stat

import pytest

from tests.test_e2e import check_books, run_ok

pytestmark = pytest.mark.slow

TCP = ["cluster.control=tcp", "tensor_channel.trajectories=zmq", "tensor_channel.weights=zmq"]


def test_tcp_curve_fleet_keeps_exact_books(tmp_path):
    run_dir = tmp_path / "run"
    run_ok(run_dir, *TCP)
    check_books(run_dir, eta=1)
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert all(e.startswith("tcp://") for e in [endpoints["control"], endpoints["trajectories"], *endpoints["rewards"]])
    for name in ("server.key", "client.key", "roster.json"):
        assert stat.S_IMODE((run_dir / "keys" / name).stat().st_mode) == 0o600
    logs = {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    for wid in ("reward-0", "rollout-0", "rollout-1", "trainer"):
        assert f"registered {wid.split('-')[0]} {wid} " in logs["scheduler"]
    assert "refused a registration" not in logs["scheduler"]
    # every binding process ran a ZAP handler with the run's allow list
    assert all("CURVE on" in logs[w] for w in ("scheduler", "reward-0", "trainer")), sorted(logs)
