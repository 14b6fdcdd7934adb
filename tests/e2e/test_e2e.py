"""End-to-end: real fleets of processes on ZeroMQ, started by the real CLI.

Each test runs a short tiny_arith job and checks the run's books against the invariants:
staleness bound, exactly-once accounting, clean shutdown on SIGTERM, loud failure when a worker
dies. The learning bar itself is measured by the full preset (benchmarks/RESULTS.md), not here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from areal_async.api import run_command
from areal_async.app.commands.status import query_status
from tests.support.admission_gate import admission_gate
from tests.support.fleet import (
    ROOT,
    assert_verified,
    check_books,
    cli,
    finish_ok,
    leaked_segments,
    read_jsonl,
    run_ok,
    stop,
    wait_for,
    wait_for_metrics,
    wait_registered,
)
from tests.support.procs import descendants, survivors

pytestmark = pytest.mark.slow


def test_dynamic_filter_refills_under_eta_and_books_every_drop(tmp_path):
    """Issue 26: groups of equal rewards dropped after scoring, refilled under the same eta, booked with the
    filter's name and counted once; the objective keys reach the trainer (max_new_tokens, eos ids); verify agrees."""
    keys = ["actor.loss_agg_mode=seq-mean-token-mean", "actor.mask_no_eos_with_zero=true", "actor.eps_clip_higher=0.28"]
    # the preset's warm-up (FAST's 10 steps leave nearly every group all-wrong: the filter would drop them all)
    keys.append("sft_warmup.steps=80")
    run_ok(tmp_path / "run", "rollout.max_head_offpolicyness=1", "rollout.dynamic_filter=nonzero_std", *keys)
    trained = check_books(tmp_path / "run", eta=1)
    groups: dict[str, list] = {}
    for t in read_jsonl(tmp_path / "run" / "trajectories.jsonl"):
        groups.setdefault(t["group_id"], []).append(t)
    assert all(len({t["reward"] for t in groups[g]}) > 1 for g in {t["group_id"] for t in trained})
    dropped = {g for g, ts in groups.items() if (ts[0]["reason"] or "").startswith("dynamic_filter: nonzero_std")}
    assert all(len({t["reward"] for t in groups[g]}) == 1 for g in dropped)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    total = metrics[-1]["dynamic_filter_groups_dropped_total"]
    assert sum(m["dynamic_filter_groups_dropped"] for m in metrics) == total == len(dropped)


def test_eta_zero_is_on_policy(tmp_path):
    run_ok(tmp_path / "run", "rollout.max_head_offpolicyness=0")
    trained = check_books(tmp_path / "run", eta=0)
    assert all(t["version_min"] == t["version_max"] == t["train_step"] for t in trained)
    # the step's first forward ran while its rewards were scored (actor.forward_ahead) in some step: how many is a
    # race between the tensors and the plan (each case by itself: test_trainer_service's forward-ahead tests)
    ahead = [m["ahead_s"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert all(a >= 0 for a in ahead) and sum(a > 0 for a in ahead) >= 1, ahead


# SIGTERM stops every process the run started, leaving no shared memory: tests/e2e/test_e2e_liveness.py's
# SIGTERM test (which then resumes from the final checkpoint) proves it.


def test_a_dead_worker_fails_the_run_loudly(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli(run_dir, "total_train_steps=1000", "cluster.max_restarts=0"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_metrics(run_dir, proc)
    wait_registered(run_dir, proc, ["rollout-1"])  # it has started and logged: its last lines are shown
    started = descendants(proc.pid)
    victim = json.loads((run_dir / "pids.json").read_text())["rollout-1"]
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "worker rollout-1" in err and "killed by signal 9" in err and "  | " in err  # its last log lines
    assert "no restart: cluster.max_restarts=0" in err
    assert survivors(started, within_s=2) == []
    assert leaked_segments(run_dir) == []


def test_bad_override_is_refused_before_anything_starts(tmp_path):
    proc = subprocess.run(
        cli(tmp_path / "run", "rollout.max_head_offpolicyness=-1"), capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2
    assert "rollout.max_head_offpolicyness=-1" in proc.stderr
    assert not (tmp_path / "run").exists()


# 2 -> 1 ranks: the same-ranks case (1 -> 1, cut: a resume on the same ranks is the SIGTERM test's in
# test_e2e_liveness) plus a checkpoint written by two ranks of a killed fleet and read by one. 1 -> 2 was cut too:
# every rank resumes through the same code (app/trainer_worker.build_trainer -> restore_actor -> load_shards), and
# the exact shard values read both ways, 1 -> 2 included, are contract/test_trainer_dp.py's.
@pytest.mark.parametrize("ranks_before, ranks_after", [(2, 1)])
def test_sigkilled_trainer_resumes_from_checkpoint_with_exact_books(tmp_path, ranks_before, ranks_after):
    """Kill the trainer mid-run, rerun with recover.mode=auto: the run continues from the newest
    complete checkpoint and, across both parts, every sample is trained once or aborted. The
    checkpoint's DCP shards are read back by another number of trainer ranks.
    The first part runs behind a shut admission gate (tests/support/admission_gate.py): it can train steps
    0..9 at most, so however fast the machine the run cannot end before the kill. (Not 0..8: a fleet
    idle after step 8 would have no group open in that checkpoint, and nothing to abort as recovered.)"""
    run_dir = tmp_path / "run"
    args = ["total_train_steps=12", "saver.freq_steps=3", "saver.keep_last=2", "rollout.max_head_offpolicyness=1"]
    gate = admission_gate(tmp_path, steps=10)  # never opened: the rerun below runs without it
    proc = subprocess.Popen(
        cli(run_dir, *args, f"cluster.n_trainer_ranks={ranks_before}"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gate.env,
    )
    deadline = time.monotonic() + 180
    while len(read_jsonl(run_dir / "metrics.jsonl")) < 8 if (run_dir / "metrics.jsonl").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(json.loads((run_dir / "pids.json").read_text())["trainer"], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "worker trainer" in err
    before = read_jsonl(run_dir / "trajectories.jsonl")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    resumed_step = max(int(n.split("_")[1]) for n in ckpts)
    # checkpoints after steps 2, 5, 8, 11; 8 steps were seen and the gate stops the fleet after step 9
    assert resumed_step in (5, 8) and (run_dir / "checkpoints" / f"step_{resumed_step}" / "COMPLETE").exists()
    last_trained = max(t["train_step"] for t in before if t["status"] == "trained")  # the kill races the trainer
    assert (run_dir / "checkpoints" / f"step_{resumed_step}" / "dcp" / ".metadata").exists()

    run_ok(run_dir, *args, "recover.mode=auto", f"cluster.n_trainer_ranks={ranks_after}")
    pids = json.loads((run_dir / "pids.json").read_text())
    ranks = ["trainer"] + [f"trainer-{r}" for r in range(1, ranks_after)]
    assert sorted(k for k in pids if k.startswith("trainer")) == ranks
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(12))  # steps after the checkpoint were redone once
    final = read_jsonl(run_dir / "trajectories.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    ids = [t["id"] for t in final]
    assert len(ids) == len(set(ids)) == summary["samples_issued"] and summary["samples_lost"] == 0
    trained = [t for t in final if t["status"] == "trained"]
    assert sorted({t["train_step"] for t in trained}) == list(range(12))
    assert all(sum(t["train_step"] == s for t in trained) == 4 * 4 for s in range(12))
    recovered = [t for t in final if t["status"] == "aborted" and t["reason"].startswith("recovered")]
    assert recovered and all(not t["id"].startswith("r1-") for t in recovered)
    # what run 1 trained after the checkpoint was rolled back, and its prompts were trained again
    rolled_path = run_dir / "trajectories.rolled_back.jsonl"
    rolled = read_jsonl(rolled_path) if rolled_path.exists() else []
    lost_updates = [t for t in rolled if t["status"] == "trained"]
    assert sorted({t["train_step"] for t in lost_updates}) == list(range(resumed_step + 1, last_trained + 1))
    retrained_prompts = {t["prompt_id"] for t in trained if t["id"].startswith("r1-")}
    open_at_end = {t["prompt_id"] for t in final if t["status"] == "aborted" and t["reason"].startswith("run_end")}
    assert {t["prompt_id"] for t in lost_updates} <= retrained_prompts | open_at_end
    # nothing trained before the checkpoint was touched
    kept = [t for t in before if t["status"] == "trained" and t["train_step"] <= resumed_step]
    assert all(t in final for t in kept)
    # the trainer rolled its own record back to the same checkpoint: the three sources agree
    assert_verified(run_dir, 12)
    # (when the kill landed just after the newest checkpoint, there is nothing to roll back and no file)
    undone_path = run_dir / "trainer_steps.rolled_back.jsonl"
    assert undone_path.exists() or last_trained == resumed_step
    undone = {json.loads(x)["step"] for x in undone_path.read_text().splitlines()} if undone_path.exists() else set()
    assert set(range(resumed_step + 1, last_trained + 1)) <= undone
    assert not undone or min(undone) == resumed_step + 1


def test_async_fleet_on_shm_trajectories_and_zmq_weights_keeps_staleness_bound_and_books(tmp_path):
    """At eta = 2 the run is really asynchronous and keeps its staleness bound and exact books, with the CPU
    channels the default does not use: trajectories over shm, weights over zmq in buckets of 64 KiB. (The default
    channels, zmq and shm, run in every other fleet here; gloo for both, with 2 trainer ranks, in
    test_e2e_cluster's gloo fleet.)"""
    run_dir = tmp_path / "run"
    run_ok(
        run_dir,
        "tensor_channel.trajectories=shm",
        "tensor_channel.weights=zmq",
        "rollout.max_head_offpolicyness=2",
        "tensor_channel.bucket_mb=0.0625",
    )
    trained = check_books(run_dir, eta=2)
    assert any(t["version_min"] < t["train_step"] for t in trained)  # asynchrony really happened
    for r in range(2):  # every rollout worker loaded the last published version over the channel
        log = (run_dir / "logs" / f"rollout-{r}.log").read_text()
        assert "exiting with code 0" in log
    assert json.loads((run_dir / "summary.json").read_text())["version"] == 6


def test_gpu_sglang_backend_without_sglang_is_refused_clearly(tmp_path):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: the GPU preset would start real servers")
    proc = subprocess.run(
        run_command(ROOT / "configs/boba_grpo.yaml", tmp_path / "run", progress=True),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "sglang package is not installed" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_cpu_affinity_pins_each_role_and_its_children(tmp_path):
    """cluster.cpu_affinity: the trainer on one CPU, everything else on another; every thread of
    every worker, and the reward worker's checking processes, carry their role's pin."""
    cpus = sorted(os.sched_getaffinity(0))
    mine, rest = cpus[0], cpus[-1]  # the same CPU on a 1-core machine: the pins are still checked
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli(
            run_dir,
            "total_train_steps=1000",
            f"cluster.cpu_affinity.trainer={mine}",
            *(f"cluster.cpu_affinity.{r}={rest}" for r in ("scheduler", "rollout", "reward")),
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_metrics(run_dir, proc)
        roles = {}
        for pid in descendants(proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
                pins = {frozenset(os.sched_getaffinity(t)) for t in threads}
            except (OSError, ProcessLookupError):
                continue
            role = (
                argv[argv.index("--worker-id") + 1]
                if "--worker-id" in argv
                else "reward-pool"
                if "areal_async.reward._child" in argv
                else "other"
            )
            roles[role] = pins
        assert {"scheduler", "trainer", "rollout-0", "rollout-1", "reward-0", "reward-pool"} <= set(roles), roles
        for role, pins in roles.items():
            if role != "other":
                assert pins == {frozenset({mine if role == "trainer" else rest})}, (role, pins)
        assert os.sched_getaffinity(proc.pid) == set(cpus)  # the supervisor itself is not pinned
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_unavailable_cpus_are_refused_before_anything_starts(tmp_path):
    bad = max(os.sched_getaffinity(0)) + 1000
    proc = subprocess.run(
        cli(tmp_path / "run", f"cluster.cpu_affinity.trainer=0,{bad}"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert f"cluster.cpu_affinity.trainer='0,{bad}': CPU(s) [{bad}] are not available here" in proc.stderr
    assert not (tmp_path / "run").exists()


def stopped_holding(run_dir: Path, proc: subprocess.Popen, rollout: tuple[str, int], reward_pid: int) -> int:
    """SIGSTOP the rollout worker ``rollout`` (id, pid) and, once the scheduler has a group out on it, the reward
    worker too: then that group can be neither generated nor scored, so the worker holds it when it is killed
    (CI once killed both idle: the fleet had filled the gate and nothing was held). The groups it holds, from
    ``areal-async status``; if the held group was scored in between, the reward worker goes on and it tries again."""
    wid, pid = rollout
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 120

    def held() -> int:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return next(w["groups"] for w in query_status(run_dir, timeout_s=20).workers if w["worker_id"] == wid)

    try:
        while time.monotonic() < deadline:
            if held():
                os.kill(reward_pid, signal.SIGSTOP)
                time.sleep(0.5)  # what either sent before it stopped reaches the scheduler
                if n := held():
                    return n
                os.kill(reward_pid, signal.SIGCONT)
            time.sleep(0.2)
        raise AssertionError(f"the scheduler put no group on the stopped {wid} within 120 s")
    except BaseException:  # resumed, so the supervisor's SIGTERM is acted on, then the fleet stopped
        for p in (pid, reward_pid):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:  # already gone
                pass
        if proc.poll() is None:
            stop(proc)
        raise


def test_killed_rollout_and_reward_workers_are_restarted_and_the_books_stay_exact(tmp_path):
    """SIGKILL a rollout worker and the reward worker mid-run: the supervisor restarts each, the
    scheduler aborts and re-issues what they held, and the run finishes with every sample
    trained or aborted exactly once.
    A shut admission gate (tests/support/admission_gate.py) holds the fleet at 8 of its 12 steps until the
    scheduler has seen both new incarnations register, so the run cannot end before they do, however fast
    the machine (before, 80 steps were to make that likely). Both are stopped before they are killed, the
    rollout worker holding a group it cannot finish (``stopped_holding``), so there is always work to re-issue."""
    run_dir = tmp_path / "run"
    steps = 12
    gate = admission_gate(tmp_path, steps=8)
    proc = subprocess.Popen(
        cli(run_dir, f"total_train_steps={steps}", "rollout.max_head_offpolicyness=1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gate.env,
    )
    wait_for_metrics(run_dir, proc)
    wait_registered(run_dir, proc, ["rollout-1", "reward-0"])  # each registers twice below: killed only once it did
    pids = json.loads((run_dir / "pids.json").read_text())
    assert stopped_holding(run_dir, proc, ("rollout-1", pids["rollout-1"]), pids["reward-0"]) >= 1
    os.kill(pids["rollout-1"], signal.SIGKILL)
    os.kill(pids["reward-0"], signal.SIGKILL)
    sched_log = run_dir / "logs" / "scheduler.log"
    again = ("registered rollout rollout-1 (pid ", "registered reward reward-0 (pid ")
    try:  # each registered twice: its first incarnation, then the one the supervisor restarted
        wait_for(lambda: all(sched_log.read_text().count(r) == 2 for r in again), 180, "both restarts to register")
    except AssertionError:
        stop(proc)
        raise
    gate.open()
    err = finish_ok(proc)
    assert "worker rollout-1" in err and "restarting it (1/2)" in err
    assert "worker reward-0" in err
    new = json.loads((run_dir / "pids.json").read_text())
    assert new["rollout-1"] != pids["rollout-1"] and new["reward-0"] != pids["reward-0"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"] and summary["samples_lost"] == 0
    assert sum(t["status"] == "trained" for t in trajs) == summary["samples_trained"] == steps * 4 * 4
    reasons = " ".join(t["reason"] for t in trajs if t["status"] == "aborted")
    # the scheduler saw rollout-1's new incarnation and re-issued the group(s) its old one held
    assert f"worker_lost: rollout-1 (restarted (pid {pids['rollout-1']} -> {new['rollout-1']}))" in reasons
    assert_verified(run_dir, steps)
    assert leaked_segments(run_dir) == []
