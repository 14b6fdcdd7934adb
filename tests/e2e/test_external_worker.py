"""Bring-your-own workers: the example external reward worker (workers/external_reward.py) scores every
group of a real fleet that has no built-in reward worker; killed midway, its groups are re-issued and
a second external worker finishes the run with exact books."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async import Fleet, load_config
from areal_async.client.reward import RewardWorker
from workers.external_reward import score

from areal_async.base.runkeys import write_run_keys
from tests.support.admission_gate import admission_gate
from tests.support import fleet
from tests.support.fleet import assert_verified, wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = [  # the fleet's short run, with its one reward worker outside it
    *fleet.FAST,
    # 10 s (20 heartbeats of fleet.FAST's 0.5 s), not 3: a loaded runner can stall a live worker for 3 s, which
    # the fleet would declare lost; still far below the step timeout, so a killed worker is lost well before it
    "cluster.worker_timeout_s=10",
    "cluster.n_reward_workers=0",
    "cluster.n_external_reward_workers=1",
]


def external(run_dir: Path, worker_id: str, cmd: list[str] | None = None, *extra: str) -> subprocess.Popen:
    log = open(run_dir / f"{worker_id}.log", "wb")
    if cmd is None:
        cmd, extra = [sys.executable, "-m", "workers.external_reward", "--worker-id", worker_id], ()
        args = [*cmd, str(run_dir)]
    else:
        args = [*cmd, str(run_dir), worker_id, *extra]
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_example_score_by_hand():
    assert score("3+4=\\boxed{07}", ["7"]) == 1.0  # zero-padded, as the tiny task writes it
    assert score("\\boxed{1} then \\boxed{8}", ["8"]) == 1.0 and score("\\boxed{8} \\boxed{1}", ["8"]) == 0.0
    assert score("\\boxed{x}", ["7"]) == 0.0 and score("7", ["7"]) == 0.0


@pytest.mark.slow
def test_external_reward_worker_scores_a_fleet_and_its_loss_is_reissued(tmp_path):
    run_dir = tmp_path / "run"
    with Fleet(load_config(ROOT / "configs/tiny_arith.yaml", FAST), run_dir=run_dir) as fleet:
        wait_for(lambda: (run_dir / "endpoints.json").exists(), 60, "endpoints.json")
        # ext-a scores 8 groups (2 steps of 4 prompts), then holds every later group unanswered
        a = external(run_dir, "ext-a", [sys.executable, str(ROOT / "tests" / "support" / "byo_reward_stall.py")], "8")
        wait_for(lambda: steps(run_dir) >= 2, 180, "two steps scored by ext-a")
        time.sleep(1.0)  # the groups of step 3 wait in its socket for a score nobody gives
        assert steps(run_dir) == 2 and a.poll() is None, "the fleet went on without ext-a's scores"
        a.send_signal(signal.SIGKILL)
        a.wait()
        b = external(run_dir, "ext-b")
        assert fleet.wait(timeout=240) == 0, (run_dir / "fleet.log").read_text()[-3000:]
    assert b.wait(timeout=30) == 0  # told to shut down by the scheduler like a built-in worker
    summary = fleet.summary()
    assert summary["steps"] == 6 and summary["samples_lost"] == 0
    assert summary["samples_trained"] == 6 * 4 * 4
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len({t["id"] for t in trajs}) == len(trajs) == summary["samples_issued"]
    lost = [t for t in trajs if t["status"] == "aborted" and "reward_worker_lost: ext-a" in t["reason"]]
    assert lost, "no group of the killed worker was re-issued"
    assert not list((run_dir / "logs").glob("reward-*.log"))  # no built-in reward worker ran
    sched = (run_dir / "logs" / "scheduler.log").read_text()
    assert "registered reward ext-a" in sched and "registered reward ext-b" in sched


def test_reward_worker_refuses_a_slot_the_fleet_lacks(tmp_path):
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", ["cluster.n_external_reward_workers=1"])
    (tmp_path / "config.yaml").write_text(__import__("areal_async.config", fromlist=["to_yaml"]).to_yaml(cfg))
    (tmp_path / "endpoints.json").write_text(
        json.dumps(
            {"control": "ipc:///x", "trajectories": "ipc:///y", "rewards": ["ipc:///r0", f"ipc://{tmp_path}/gone/r1"]}
        )
    )
    write_run_keys(tmp_path, {})  # a run directory holds its keys (the supervisor writes them)
    with pytest.raises(ValueError, match="slot=1: .* keeps 1 bring-your-own reward slot"):
        RewardWorker(tmp_path, score, slot=1)
    with pytest.raises(FileNotFoundError, match="is a fleet running"):
        RewardWorker(tmp_path / "nowhere", score)
    # the run's ipc directory is gone (the fleet ended): a plain error, not a zmq traceback
    with pytest.raises(
        RuntimeError, match=r"cannot serve reward slot 0 at ipc://.*/gone/r1 .*has the fleet in .* ended"
    ):
        RewardWorker(tmp_path, score, slot=0, worker_id="late").run()


def test_a_fleet_with_nobody_to_score_is_refused():
    from areal_async.config import ConfigError

    with pytest.raises(ConfigError, match="n_reward_workers=0: expected >= 1, or n_external_reward_workers >= 1"):
        load_config(ROOT / "configs/tiny_arith.yaml", ["cluster.n_reward_workers=0"])


def run_with_byo_rollout(tmp_path, monkeypatch, script: str, extra: list[str] = ()) -> tuple[Fleet, int]:
    """A short fleet with one built-in rollout worker and ``tests/support/<script>`` as a second, outside it.
    The fleet admits nothing (a shut admission gate, tests/support/admission_gate.py) until the external
    worker has registered, so a fast fleet cannot train its 6 steps on the built-in worker alone.
    Returns the fleet (ended, exit 0) and the external process's exit code."""
    run_dir = tmp_path / "run"
    gate = admission_gate(tmp_path, steps=0)
    monkeypatch.setenv("PYTHONPATH", gate.env["PYTHONPATH"])  # the fleet's scheduler runs the gate
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", FAST[:6] + ["cluster.n_rollout_workers=1", *extra])
    log = open(tmp_path / "byo-rollout.log", "wb")
    # started first: it imports torch, then waits for the fleet's endpoints.json
    ext = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / script), str(run_dir), "byo-rollout"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: (tmp_path / "byo-imported").exists(), 240, "the external rollout worker's imports")
        with Fleet(cfg, run_dir=run_dir) as fleet:
            sched_log = run_dir / "logs" / "scheduler.log"

            def registered() -> bool:
                return sched_log.exists() and "registered rollout byo-rollout " in sched_log.read_text()

            wait_for(registered, 240, "the external rollout worker's registration")
            gate.open()
            assert fleet.wait(timeout=300) == 0, (run_dir / "fleet.log").read_text()[-3000:]
        return fleet, ext.wait(timeout=120)
    finally:
        if ext.poll() is None:  # never left behind, whatever failed
            ext.kill()
            ext.wait()


@pytest.mark.slow
def test_external_rollout_worker_generates_for_a_fleet(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    fleet, code = run_with_byo_rollout(tmp_path, monkeypatch, "byo_rollout.py")
    assert code == 0, (tmp_path / "byo-rollout.log").read_text()[-3000:]
    summary = fleet.summary()
    assert summary["samples_lost"] == 0 and summary["samples_trained"] == 6 * 4 * 4
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    by_worker = {t["worker"] for t in trajs if t["status"] == "trained"}
    assert "byo-rollout" in by_worker, by_worker  # its groups were trained like the built-in worker's


@pytest.mark.slow
def test_tensors_lost_with_their_rollout_worker_are_aborted_and_the_plan_revised(tmp_path, monkeypatch):
    """The external rollout worker's first groups report ready and get scored, but their tensors never
    leave it, and it dies 2 s later (tests/support/byo_rollout_lossy.py). Lost after 10 s without a
    heartbeat (FAST's worker_timeout_s), it is asked about: the trainer names exactly the dropped samples,
    the scheduler aborts them as trajectories_lost and revises the plan; the run trains all 6 steps of full
    batches on the built-in worker, and the books agree with the trainer's and the rollouts' own records."""
    run_dir = tmp_path / "run"
    fleet, code = run_with_byo_rollout(tmp_path, monkeypatch, "byo_rollout_lossy.py")  # FAST's worker_timeout_s=10
    assert code == 9  # it died as planned (os._exit), not at the run's end
    dropped = json.loads((tmp_path / "dropped.json").read_text())
    summary = fleet.summary()
    assert summary["samples_lost"] == 0 and summary["samples_trained"] == 6 * 4 * 4
    trajs = {t["id"]: t for t in map(json.loads, (run_dir / "trajectories.jsonl").read_text().splitlines())}
    lost = sorted(i for i, t in trajs.items() if (t["reason"] or "").startswith("trajectories_lost"))
    assert dropped and lost == sorted(dropped), (lost, dropped)
    assert all(trajs[i]["status"] == "aborted" for i in dropped)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"{len(dropped)} of the " in trainer_log and "never arrived: given up on" in trainer_log
    assert_verified(run_dir, 6)
