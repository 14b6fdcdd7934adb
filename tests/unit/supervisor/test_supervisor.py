"""The supervisor's watch loop on real (stand-in) child processes: restart policy, loud
failure, and the end of a run when a worker outlives the scheduler."""

import sys
import time


from areal_async.config import from_dict
from areal_async.supervisor import fleet
from areal_async.supervisor.fleet import Child, Supervisor
from areal_async.supervisor.plan import restart_blocker

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
EXIT0 = [sys.executable, "-c", "pass"]


def supervisor(tmp_path, *overrides):
    sup = Supervisor(from_dict({}, list(overrides)), tmp_path, progress=False)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return sup


def child(sup, name, cmd):
    log = sup.run_dir / "logs" / f"{name}.log"
    c = Child(name, sup._spawn(cmd, log, None), log, cmd)
    sup.children.append(c)
    return c


def test_a_dead_rollout_worker_is_restarted_until_the_budget_is_spent(tmp_path, capsys):
    sup = supervisor(tmp_path, "cluster.max_restarts=2")
    crash = [sys.executable, "-c", "import sys; print('dying'); sys.exit(3)"]
    child(sup, "scheduler", SLEEP)
    roll = child(sup, "rollout-0", crash)
    try:
        assert sup.watch(poll_s=0.05) == 1
    finally:
        sup.stop_all()
    err = capsys.readouterr().err
    assert err.count("restarting it") == 2 and "(2/2)" in err
    assert "worker rollout-0" in err and "exited with code 3" in err
    assert "the run failed (no restart: 2 restart(s) used)" in err and "  | dying" in err
    assert roll.restarts == 2 and (tmp_path / "pids.json").exists()


def test_trainer_is_never_restarted_and_gloo_channels_block_restarts(tmp_path, capsys):
    sup = supervisor(tmp_path)
    child(sup, "scheduler", SLEEP)
    child(sup, "trainer", [sys.executable, "-c", "import sys; sys.exit(1)"])
    try:
        assert sup.watch(poll_s=0.05) == 1
    finally:
        sup.stop_all()
    assert "restarting" not in capsys.readouterr().err
    assert restart_blocker(from_dict({}, ["tensor_channel.trajectories=gloo"])).startswith("tensor channel(s) gloo")
    assert restart_blocker(from_dict({}, ["cluster.max_restarts=0"])) == "cluster.max_restarts=0"
    assert restart_blocker(from_dict({}, [])) is None


def test_workers_outliving_a_finished_run_are_stopped(tmp_path, capsys, monkeypatch):
    """A worker restarted just as the run ended never hears Shutdown; once the scheduler has
    exited 0 the supervisor waits RUN_END_GRACE_S, then stops it and the run still succeeds."""
    monkeypatch.setattr(fleet, "RUN_END_GRACE_S", 0.5)
    sup = supervisor(tmp_path)
    child(sup, "scheduler", EXIT0)
    late = child(sup, "rollout-1", SLEEP)
    t0 = time.monotonic()
    assert sup.watch(poll_s=0.05) == 0
    assert 0.5 <= time.monotonic() - t0 < 15
    assert late.proc.poll() is not None  # stopped, and reaped
    assert "rollout-1 still ran 0s after the scheduler exited; stopping them" in capsys.readouterr().err


def test_no_restart_once_the_scheduler_has_finished(tmp_path, capsys):
    sup = supervisor(tmp_path)
    # the scheduler has exited 0 before the worker fails: waited for, not slept on (a loaded runner can take
    # longer than any fixed sleep to start and end an interpreter)
    assert child(sup, "scheduler", EXIT0).proc.wait(30) == 0
    child(sup, "reward-0", [sys.executable, "-c", "import sys; sys.exit(2)"])
    try:
        assert sup.watch(poll_s=0.05) == 1
    finally:
        sup.stop_all()
    err = capsys.readouterr().err
    assert "restarting" not in err and "(no restart: the run had ended)" in err


def test_the_end_of_a_run_is_seen_without_waiting_a_whole_poll(tmp_path):
    """Once a child has exited (here the scheduler, as at a run's end) the watch looks again every
    ENDING_POLL_S, not every poll_s: the last worker's exit ends the watch long before one 10 s poll."""
    sup = supervisor(tmp_path)
    child(sup, "rollout-0", [sys.executable, "-c", "import time; time.sleep(1.0)"])
    child(sup, "scheduler", EXIT0).proc.wait(30)
    t = time.monotonic()
    try:
        assert sup.watch(poll_s=10.0) == 0
    finally:
        sup.stop_all()
    assert time.monotonic() - t < 5.0
