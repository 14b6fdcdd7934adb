"""End-to-end liveness: each hang of issue 12 reproduced on a real fleet (real processes,
ZeroMQ, signals) must now end: loudly, by recovery, or by a group deadline.

Faults come from outside the code under test: signals (SIGSTOP, SIGTERM) or a
``sitecustomize`` on PYTHONPATH that patches one worker process at start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from areal_async.api import run_command

from tests.support.admission_gate import admission_gate
from tests.support.fleet import FAST, ROOT, TINY, cli, finish_ok, leaked_segments, read_jsonl, stop, wait_for
from tests.support.procs import alive, descendants, survivors

pytestmark = pytest.mark.slow

B, N = 4, 4  # train_dataset.batch_size and gconfig.n_samples of test_e2e.FAST


def start(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cli(run_dir, *overrides), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_steps(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if time.monotonic() >= deadline:
            stop(proc)  # a failing test leaves no fleet behind
            raise AssertionError(f"fewer than {n} steps within {timeout}s")
        time.sleep(0.1)


def check_exact_books(run_dir: Path, steps: int) -> tuple[dict, list[dict]]:
    """Every trainer step once, B*N samples each, every issued sample ended once, none lost."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"] and summary["samples_lost"] == 0
    trained = [t for t in trajs if t["status"] == "trained"]
    assert len(trained) == summary["samples_trained"] == steps * B * N
    assert all(sum(t["train_step"] == s for t in trained) == B * N for s in range(steps))
    assert all(t["reason"] for t in trajs if t["status"] == "aborted")
    return summary, trajs


def with_sitecustomize(tmp_path: Path, code: str) -> dict:
    d = tmp_path / "inject"
    d.mkdir()
    (d / "sitecustomize.py").write_text(code)
    return dict(os.environ, PYTHONPATH=str(d))


SCHEDULER_BUG = """
import os
import sys
# the scheduler started as `python -m workers.scheduler`, or the fork server it is forked from (cluster.fork_server:
# only the scheduler runs these classes; a forked child starts no interpreter, so nothing would patch it there)
if any(m in getattr(sys, "orig_argv", []) for m in ("workers.scheduler", "areal_async.supervisor.zygote")):
    sys.path.insert(0, os.getcwd())  # the checkout the fleet runs from (as `python -m` would put first)
    from areal_async.scheduler import core

    _orig = core.SchedulerCore.on_step_done

    def on_step_done(self, step, version, *rest):
        if step == 2:
            raise RuntimeError("injected: not a refusal, a bug in the scheduler")
        return _orig(self, step, version, *rest)

    core.SchedulerCore.on_step_done = on_step_done
"""


def test_scheduler_exception_mid_run_ends_the_run_loudly_in_time(tmp_path):
    """Before: the serve task died, the scheduler process lived on, and the run hung for ever."""
    run_dir, step_timeout = tmp_path / "run", 20
    proc = start(
        run_dir,
        "total_train_steps=30",
        f"cluster.step_timeout_s={step_timeout}",
        env=with_sitecustomize(tmp_path, SCHEDULER_BUG),
    )
    wait_steps(run_dir, proc, 2)
    # step 2 is next: the scheduler raises when it ends
    started = descendants(proc.pid)
    # in time: the run ends (no hang: communicate's timeout), and by the scheduler's own exit, not by the step
    # watchdog (step_timeout) or a loss; not a wall-time bound, which a loaded runner stretches past any margin
    _, err = proc.communicate(timeout=step_timeout + 10 + 60)
    assert proc.returncode == 1
    assert "worker scheduler" in err and "exited with code 70" in err and "the run failed" in err
    assert "no trainer step for" not in err and "declared lost" not in err, err[-3000:]
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert "Traceback" in log and "RuntimeError: injected: not a refusal" in log
    assert survivors(started, within_s=2) == []
    assert leaked_segments(run_dir) == []
    ids = [t["id"] for t in read_jsonl(run_dir / "trajectories.jsonl")]
    assert len(ids) == len(set(ids))


def test_sigstopped_trainer_is_lost_killed_and_the_run_recovers_with_exact_books(tmp_path):
    """Before: the trainer was declared lost, never stopped, its TrainStepDone refused, and six
    processes idled for ever. Now: told, killed, and the fleet relaunched from a checkpoint.
    A shut admission gate holds the fleet at 5 steps until the trainer is stopped: it cannot finish first."""
    run_dir, steps = tmp_path / "run", 10
    gate = admission_gate(tmp_path, steps=5)
    proc = start(
        run_dir,
        f"total_train_steps={steps}",
        "saver.freq_steps=2",
        # 10 s (20 heartbeats of FAST's 0.5 s), not 3: a loaded runner can stall a live worker for 3 s, which
        # would be declared lost too; the trainer is stopped for good, so any timeout finds it
        "cluster.worker_timeout_s=10",
        "cluster.step_timeout_s=30",
        "recover.retries=1",
        "rollout.max_head_offpolicyness=1",
        env=gate.env,
    )
    wait_steps(run_dir, proc, 3)
    trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
    os.kill(trainer, signal.SIGSTOP)
    gate.open()  # the stopped trainer trains nothing more; the recovered fleet finds the gate open
    err = finish_ok(proc, timeout=240)
    assert "worker trainer" in err and "declared lost by the scheduler: no heartbeat for" in err
    assert "recovering the run (1/1 in a row, 1 in all) from the newest complete checkpoint" in err
    assert not alive(trainer)
    summary, trajs = check_exact_books(run_dir, steps)
    assert summary["recoveries"] == 1
    assert any(t["reason"].startswith("recovered") for t in trajs if t["status"] == "aborted")
    lost = read_jsonl(run_dir / "lost.jsonl")
    assert [(r["worker"], r["pid"]) for r in lost] == [("trainer", trainer)]


def test_stopped_reward_worker_groups_end_by_deadline_and_are_re_issued(tmp_path):
    """A reward worker holds requests and never answers (SIGSTOP; its heartbeat timeout is far
    away). Before: those groups waited as long as it did. Now: aborted at reward.deadline_s,
    prompts re-issued, its late scores refused; the books stay exact.
    A shut admission gate holds the fleet at 8 steps until the scheduler has refused reward-0's late
    scores, so a fast machine cannot finish the run on reward-1 alone while reward-0 is stopped."""
    run_dir, steps = tmp_path / "run", 14
    gate = admission_gate(tmp_path, steps=8)
    proc = start(
        run_dir,
        f"total_train_steps={steps}",
        "cluster.n_reward_workers=2",
        "reward.deadline_s=2",
        "cluster.worker_timeout_s=120",
        "rollout.max_head_offpolicyness=1",
        env=gate.env,
    )
    wait_steps(run_dir, proc, 2)
    reward = json.loads((run_dir / "pids.json").read_text())["reward-0"]
    sched_log = run_dir / "logs" / "scheduler.log"
    os.kill(reward, signal.SIGSTOP)
    time.sleep(6)  # the outage (3x reward.deadline_s), not a synchronisation: the waits below are
    wait_for(lambda: "past their deadline aborted" in sched_log.read_text(), 120, "a group aborted by its deadline")
    os.kill(reward, signal.SIGCONT)
    wait_for(lambda: "ignored reward from reward-0" in sched_log.read_text(), 120, "reward-0's late scores refused")
    gate.open()
    finish_ok(proc, timeout=240)
    summary, trajs = check_exact_books(run_dir, steps)
    expired = [t for t in trajs if t["status"] == "aborted" and t["reason"].startswith("deadline: no score")]
    assert expired and summary["prompts_reissued"] >= len(expired) // N
    trained_prompts = {t["prompt_id"] for t in trajs if t["status"] == "trained"}
    open_at_end = {t["prompt_id"] for t in trajs if t["reason"] and t["reason"].startswith("run_end")}
    dropped = {t["prompt_id"] for t in trajs if t["reason"] and "dropped after" in t["reason"]}
    assert {t["prompt_id"] for t in expired} <= trained_prompts | open_at_end | dropped
    assert "ignored reward from reward-0" in sched_log.read_text()  # its late scores


def test_sigterm_saves_a_final_checkpoint_stops_everything_and_resume_continues_exactly(tmp_path):
    run_dir, steps = tmp_path / "run", 16
    args = [f"total_train_steps={steps}", "saver.freq_steps=6", "saver.keep_last=3", "rollout.max_head_offpolicyness=1"]
    gate = admission_gate(tmp_path, steps=12)  # steps 0..11 at most before the signal; never opened
    proc = start(run_dir, *args, env=gate.env)
    wait_steps(run_dir, proc, 8)  # the periodic checkpoint after step 5 exists; the next is after 11
    # a quiet machine may train up to step 11 (and save it) between here and the signal's arrival, no further
    started = descendants(proc.pid)
    assert len(started) >= 5  # scheduler, reward (+ its pool), trainer, 2 rollouts: all must be gone below
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "final checkpoint saved" in err
    assert survivors(started, within_s=2) == []
    assert leaked_segments(run_dir) == []
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    final = max(ckpts)
    assert 5 in ckpts and 7 <= final < steps - 1 and (run_dir / "checkpoints" / f"step_{final}" / "COMPLETE").exists()
    trained_before = max(
        t["train_step"] for t in read_jsonl(run_dir / "trajectories.jsonl") if t["status"] == "trained"
    )
    assert trained_before == final  # the final checkpoint holds every step trained

    err = finish_ok(start(run_dir, *args, "recover.mode=auto"))
    check_exact_books(run_dir, steps)
    rolled = run_dir / "trajectories.rolled_back.jsonl"
    assert not rolled.exists() or all(t["status"] != "trained" for t in read_jsonl(rolled))  # nothing trained lost


def _kill_left(pids: set[int]) -> None:
    """A failing test leaves no fleet behind: SIGKILL to the pids it saw under its supervisor, still alive."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_alive_steps(run_dir: Path, proc: subprocess.Popen, n: int, tty: int, seen: list[bytes]) -> None:
    """``wait_steps`` for a supervisor whose output is a pty, until its progress line has shown them there: what it
    writes is read meanwhile (``tty``, the master end, non-blocking), so it never waits on a full terminal."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not path.exists() or len(path.read_text().splitlines()) < n or b"step" not in b"".join(seen):
        if proc.poll() is not None or time.monotonic() >= deadline:
            stop(proc)
            raise AssertionError(f"fewer than {n} steps shown within 180 s (supervisor exit {proc.returncode})")
        try:
            seen.append(os.read(tty, 65536))
        except BlockingIOError:
            time.sleep(0.1)


def test_the_terminal_hanging_up_stops_the_fleet_and_nohup_keeps_it_running(tmp_path):
    """The terminal the run was started from closes: the supervisor's output is a terminal whose writes now
    fail (the pty's other end closed) and it gets SIGHUP. Its workers run in sessions of their own and never
    see the hangup, so a supervisor that died of it would leave them running unwatched (and, held at the gate,
    never ending). It stops them as it does on SIGTERM (a final checkpoint first) and exits 128 + 1.
    Started under nohup (SIGHUP ignored), the same signal changes nothing: the run trains on."""
    args = ["total_train_steps=16"]
    gate = admission_gate(tmp_path, steps=12)  # never opened: without a stop the fleet waits forever
    master, slave = os.openpty()
    run_dir = tmp_path / "hangup"
    cmd = run_command(TINY, run_dir, [*FAST, *args], progress=True)  # the live line a user's terminal shows
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=gate.env)
    os.close(slave)
    os.set_blocking(master, False)
    seen: list[bytes] = []
    started: set[int] = set()
    try:
        _wait_alive_steps(run_dir, proc, 2, master, seen)
        started = descendants(proc.pid)
        assert len(started) >= 5  # scheduler, reward (+ its pool), trainer, 2 rollouts
        os.close(master)  # the terminal is gone: every write to it fails from now on
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=90) == 128 + signal.SIGHUP
        assert survivors(started, within_s=5) == []
    finally:
        _kill_left(started | ({proc.pid} if proc.poll() is None else set()))
    assert leaked_segments(run_dir) == []
    final = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()]
    assert final, "the stop on SIGHUP saved no final checkpoint"

    run_dir = tmp_path / "nohup"
    proc = subprocess.Popen(
        cli(run_dir, *args),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gate.env,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    started = set()
    try:
        wait_steps(run_dir, proc, 2)
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGHUP)
        time.sleep(2)  # SIGHUP's default action would have ended it at once
        assert proc.poll() is None
        wait_steps(run_dir, proc, 4)  # and it trains on
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert survivors(started, within_s=5) == []
    finally:
        _kill_left(started | ({proc.pid} if proc.poll() is None else set()))


@pytest.mark.parametrize("launch", [["cluster.fork_server=true"], ["cluster.fork_server=false"]], ids=["fork", "popen"])
def test_a_supervisor_killed_outright_leaves_no_worker_running(tmp_path, launch):
    """SIGKILL to the supervisor (the OOM killer, ``kill -9``): it stops nobody, and its workers run in sessions
    of their own, held at the gate. Each asked Linux to end it with its parent (``base/parent.py``): the
    supervisor for a process it started, the fork server (which ends when the supervisor's pipe closes) for one
    it forked; so every process under the supervisor ends within seconds, nothing is left to reap by hand. (With
    ``rollout.backend=sglang`` its CPU SGLang servers too: not here, see the session 13 note: one CI run kept one
    process of that fleet alive past 30 s, which did not happen in any run on the development machine.)"""
    gate = admission_gate(tmp_path, steps=12)  # never opened: the fleet never ends on its own
    run_dir = tmp_path / "run"
    proc = start(run_dir, "total_train_steps=16", *launch, env=gate.env)
    started: set[int] = set()
    try:
        wait_steps(run_dir, proc, 2)
        started = descendants(proc.pid)
        assert len(started) >= 5  # scheduler, reward (+ its pool), trainer, 2 rollouts (+ the fork server)
        names = {pid: _cmdline(pid) for pid in started}  # read now: a failure names what survived
        proc.kill()
        proc.communicate(timeout=30)
        assert [names[pid] for pid in survivors(started, within_s=30)] == []
    finally:
        _kill_left(started | ({proc.pid} if proc.poll() is None else set()))


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return f"{pid}: (gone)"
