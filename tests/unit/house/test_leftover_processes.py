"""``tests/conftest.py``'s ``pytest_runtest_call``: what a failing test body started and left running is killed
(real processes, the hook driven as pytest drives a hookwrapper)."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.conftest import pytest_runtest_call
from tests.support.procs import alive


class _Outcome:
    def __init__(self, failed: bool):
        self.excinfo = (RuntimeError, RuntimeError("Timeout (>300.0s) from pytest-timeout."), None) if failed else None


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _drive(body_started: list, failed: bool) -> None:
    hook = pytest_runtest_call(item=None)
    next(hook)  # before the body
    body_started.append(_sleeper())  # what the body starts
    try:
        hook.send(_Outcome(failed))
    except StopIteration:
        pass


def test_a_failed_body_s_processes_are_killed_and_older_ones_are_not():
    fixture_s = _sleeper()  # there before the body (a fixture's server): left alone
    started: list[subprocess.Popen] = []
    try:
        _drive(started, failed=True)
        assert started[0].wait(timeout=10) == -signal.SIGKILL
        assert alive(fixture_s.pid) and fixture_s.poll() is None
    finally:
        for p in [fixture_s, *started]:
            p.kill()
            p.wait()


def test_a_passing_body_s_processes_are_left_to_it():
    started: list[subprocess.Popen] = []
    try:
        _drive(started, failed=False)
        assert started[0].poll() is None and alive(started[0].pid)
    finally:
        for p in started:
            p.kill()
            p.wait()
