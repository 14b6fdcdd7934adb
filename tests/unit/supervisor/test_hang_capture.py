"""Hang capture with real processes: faulthandler on SIGUSR2 in the worker, the supervisor's capture
(a running worker, a SIGSTOPped one, one without the handler), and read back as doctor reads it."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_async.base.stacks import read_hangs, register_stack_dump
from areal_async.supervisor.hangs import capture_stacks, catches, proc_state

WORKER = textwrap.dedent(
    """
    import sys, time
    from areal_async.base.stacks import register_stack_dump
    if sys.argv[3] == "register":
        register_stack_dump(sys.argv[1], sys.argv[2])
    print("ready", flush=True)
    def waiting_in_a_named_function():
        while True:
            time.sleep(0.01)
    waiting_in_a_named_function()
    """
)


def start(run_dir, wid, register=True):
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(run_dir), wid, "register" if register else "no"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=5)


def test_capture_dumps_running_and_stopped_workers_and_leaves_the_others(tmp_path, procs):
    procs += [start(tmp_path, "rollout-0"), start(tmp_path, "trainer"), start(tmp_path, "plain", register=False)]
    running, stopped, plain = procs
    stopped.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while proc_state(stopped.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert catches(running.pid, signal.SIGUSR2) and not catches(plain.pid, signal.SIGUSR2)
    cap = capture_stacks(tmp_path, {"rollout-0": running.pid, "trainer": stopped.pid, "plain": plain.pid}, "stuck")
    w = cap["workers"]
    assert (w["rollout-0"]["state"], w["trainer"]["state"]) in {("S", "T"), ("R", "T")}
    assert w["rollout-0"]["dumped"] and w["trainer"]["dumped"] and not w["plain"]["dumped"]
    assert "no stack handler" in w["plain"]["note"]
    assert proc_state(stopped.pid) == "T"  # stopped again, as it was found
    assert plain.poll() is None  # SIGUSR2 would have killed it: it was never sent
    (back,) = read_hangs(tmp_path)
    assert back["why"] == "stuck"
    for wid in ("rollout-0", "trainer"):
        assert "waiting_in_a_named_function" in back["workers"][wid]["stacks"], back["workers"][wid]
    assert back["workers"]["plain"]["stacks"] == ""


def test_a_second_capture_reads_only_its_own_dump(tmp_path, procs):
    procs.append(start(tmp_path, "scheduler"))
    capture_stacks(tmp_path, {"scheduler": procs[0].pid}, "first")
    capture_stacks(tmp_path, {"scheduler": procs[0].pid}, "second")
    first, second = read_hangs(tmp_path)
    a, b = first["workers"]["scheduler"], second["workers"]["scheduler"]
    assert a["stacks"].count("most recent call first") >= 1 and b["stacks"].count("waiting_in_a_named") == 1
    assert b["offset"] == a["offset"] + a["bytes"]


def test_a_dead_pid_is_reported_not_signalled(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    cap = capture_stacks(tmp_path, {"gone": p.pid}, "why", wait_s=0.2)
    assert cap["workers"]["gone"]["dumped"] is False


def test_register_in_an_unwritable_place_registers_nothing(tmp_path):
    (tmp_path / "stacks").write_text("a file where the directory should be")
    assert register_stack_dump(tmp_path, "w") is None
