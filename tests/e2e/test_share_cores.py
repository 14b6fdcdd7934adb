"""cluster.share_cores as a real fleet: every torch worker (the trainer and the two rollout workers of the tiny
preset) has its byte in RUN_DIR/cores and starts with OpenMP's idle threads asleep; the table says who computes
while the run goes and is all idle once it ended; the books are exact. How much faster it is:
benchmarks/share_cores.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from areal_async.base.cores import CORES_FILE
from tests.support.admission_gate import admission_gate
from tests.support.fleet import ROOT, assert_verified, cli, finish_ok, stop, wait_for_metrics
from tests.support.procs import descendants

pytestmark = pytest.mark.slow


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _worker_id(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    return argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else None


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_torch_workers_share_one_table_and_sleep_when_idle(tmp_path):
    """The run is watched while it is sure to be running: a shut admission gate (tests/support/admission_gate.py)
    holds it at its first step until every worker was seen, then lets it go one step at a time, each watched
    from its admission to its metrics row, until someone was seen computing; then the gate opens. (Watched
    free, a run done in ~1 s after its first step could end during a stall of the test, nothing seen.)"""
    run = tmp_path / "run"
    gate = admission_gate(tmp_path, steps=1)
    proc = subprocess.Popen(
        cli(run, "total_train_steps=8", "cluster.share_cores=true"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gate.env,
    )
    workers, seen_busy = {}, set()

    def look() -> None:
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # it cannot end while the gate is shut
        for pid in descendants(proc.pid):
            try:
                if (wid := _worker_id(pid)) is not None:
                    workers[wid] = _environ(pid)
            except (OSError, ValueError):
                continue
        if (run / CORES_FILE).exists():
            seen_busy.update(i for i, b in enumerate((run / CORES_FILE).read_bytes()) if b)
        time.sleep(0.01)

    try:
        wait_for_metrics(run, proc)
        deadline = time.monotonic() + 120
        while not {"trainer", "rollout-0", "rollout-1", "scheduler", "reward-0"} <= set(workers):
            assert time.monotonic() < deadline, workers
            look()
        allowed = 1
        while not seen_busy and allowed < 8:
            allowed += 1
            gate.allow(allowed)  # this step's generation and training happen after this, before its metrics row
            deadline = time.monotonic() + 120
            while _steps(run) < allowed:
                assert time.monotonic() < deadline, f"step {allowed} not trained"
                look()
    except BaseException:
        stop(proc)
        raise
    gate.open()
    finish_ok(proc)
    assert {"trainer", "rollout-0", "rollout-1", "scheduler", "reward-0"} <= set(workers), workers
    assert all(env["OMP_WAIT_POLICY"] == "PASSIVE" for env in workers.values())
    assert all(env["MALLOC_ARENA_MAX"] == "1" for env in workers.values())  # cluster.malloc_arenas
    table = (run / CORES_FILE).read_bytes()
    assert len(table) == 3 and table == b"\0\0\0"  # trainer, rollout-0, rollout-1: all idle at the end
    assert seen_busy and seen_busy <= {0, 1, 2}  # someone was seen computing while the run went
    assert_verified(run, 8)
