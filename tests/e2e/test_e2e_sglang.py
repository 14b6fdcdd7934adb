"""End-to-end with ``rollout.backend=sglang``: the supervisor starts one CPU SGLang server per
rollout worker, weights reach them over gloo groups, and a SIGKILLed server costs no sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from areal_async.base.runkeys import load_server_key
from areal_async.rollout.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.rollout.server_auth import API_KEY_ENV
from tests.support.fleet import ROOT, assert_verified, cli, finish_ok, read_jsonl, wait_for_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def watch_versions(url: str, stop: threading.Event, seen: list) -> None:
    """Every weight_version the server reports, polled until ``stop``."""
    while not stop.is_set():
        try:
            v = call(url, "GET", "/model_info", timeout_s=2.0)["weight_version"]
            if not seen or seen[-1] != v:
                seen.append(v)
        except (ServerUnreachable, HTTPStatusError):
            pass
        time.sleep(0.05)


def test_sglang_fleet_keeps_books_weight_versions_and_survives_a_killed_server(tmp_path, monkeypatch):
    run_dir, steps, eta = tmp_path / "run", 40, 2
    proc = subprocess.Popen(
        cli(run_dir, "rollout.backend=sglang", f"total_train_steps={steps}", f"rollout.max_head_offpolicyness={eta}"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_metrics(run_dir, proc, timeout=300)
    servers = json.loads((run_dir / "endpoints.json").read_text())["servers"]
    with pytest.raises(HTTPStatusError) as refused:  # the servers serve only the run's key (server_auth.py)
        call(servers[1], "GET", "/model_info", timeout_s=5.0)
    assert refused.value.status == 401
    monkeypatch.setenv(API_KEY_ENV, load_server_key(run_dir))  # the watcher calls with the run's key
    seen: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_versions, args=(servers[1], stop, seen), daemon=True)
    watcher.start()
    pids = json.loads((run_dir / "pids.json").read_text())
    os.kill(pids["sglang-0"], signal.SIGKILL)
    err = finish_ok(proc, timeout=360)
    stop.set()
    assert "worker sglang-0" in err and "restarting it (1/2)" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"] and summary["samples_lost"] == 0
    trained = [t for t in trajs if t["status"] == "trained"]
    assert len(trained) == summary["samples_trained"] == steps * 4 * 4
    for t in trained:
        assert t["train_step"] - eta <= t["version_min"] <= t["version_max"] <= t["train_step"], t
    assert_verified(run_dir, steps)  # the trainer's and the rollouts' records agree with the books
    # the surviving server went through the versions in order (those it was polled at), up to the last steps
    versions = [int(v) for v in seen if v != "default"]
    assert versions == sorted(versions) and versions[-1] >= steps - 1, seen
    log0 = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "is down" in log0  # its worker moved the requests (revival of a restarted server: test_sglang_backend)
