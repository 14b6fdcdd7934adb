"""pyzmq's collector hazard and the test processes' guard against it (tests/support/zmq_gc.py): a context freed
by the collector together with its socket waits forever in ``term()`` unguarded, and returns guarded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.zmq_gc import CYCLE

ROOT = Path(__file__).resolve().parents[3]


def _run(mode: str, timeout: float) -> subprocess.CompletedProcess | None:
    """The cycle program in a fresh interpreter; None when it had not finished after ``timeout`` s (killed)."""
    try:
        return subprocess.run(
            [sys.executable, "-W", "always::ResourceWarning", "-c", CYCLE, mode], cwd=ROOT, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None


def test_unguarded_the_collector_waits_forever_in_term():
    """What the guard is for: the same program guarded ends in 0.1 s here (interpreter start included); 5 s is 50x."""
    assert _run("unguarded", timeout=5.0) is None


def test_guarded_the_collection_returns_and_says_what_it_left():
    done = _run("guarded", timeout=60.0)
    assert done is not None and done.returncode == 0, done and done.stderr[-2000:]
    assert done.stdout == "collected\n"
    assert "collected unclosed: not terminated" in done.stderr and "ResourceWarning" in done.stderr


@pytest.mark.parametrize("kind", ["zmq", "zmq.asyncio"])
def test_the_guard_is_installed_in_this_test_process(kind):
    """tests/conftest.py installed it for both context classes the project uses (one ``__del__`` they share)."""
    import importlib

    from zmq.sugar.context import Context

    cls = importlib.import_module(kind).Context
    assert cls.__del__ is Context.__del__ and Context.__del__.__module__ == "tests.support.zmq_gc"
