"""``base/parent.py``: a process that asks to end with its parent (real processes, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from areal_async.base.parent import PARENT_ENV
from tests.support.procs import survivors

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from areal_async.base.parent import PARENT_ENV, die_with_parent
    made = die_with_parent()
    print(made, PARENT_ENV in os.environ, flush=True)
    time.sleep(float(sys.argv[1]))
    """
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _run(env_pid: str | None, sleep_s: float = 0.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    if env_pid is not None:
        env[PARENT_ENV] = env_pid
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(sleep_s)], env=env, capture_output=True, text=True, timeout=60
    )


def test_named_by_its_real_parent_it_runs_on_and_hides_the_variable_from_its_own_children():
    done = _run(str(os.getpid()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]  # the request made; the variable taken out


def test_a_parent_that_ended_before_the_request_ends_it_at_once():
    # a pid that is not its parent: as if the parent had ended and it had been re-parented
    done = _run("1", sleep_s=30)
    assert done.returncode == -signal.SIGTERM


@pytest.mark.parametrize("value", [None, "", "abc", "-1", "12.5"])
def test_without_a_pid_in_the_variable_nothing_is_asked(value):
    """No variable (Ray, Slurm, by hand), or one that names no pid: no request, and the process runs on."""
    done = _run(value)
    assert done.returncode == 0 and done.stdout.split() == ["False", "False"], done.stderr


def test_its_parent_ending_ends_it():
    """A middle process starts the child (named as its parent) and is SIGKILLed: the child gets SIGTERM."""
    middle = textwrap.dedent(
        f"""
        import os, subprocess, sys
        env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}, "60"], env=env, stdout=subprocess.PIPE, text=True)
        child.stdout.readline()  # its request is made
        print(child.pid, flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    done = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    pid = int(done.stdout.split()[0])  # now some other process's child (init's): dead is gone or a zombie
    assert survivors({pid}, within_s=10) == []


def test_the_wrapper_asks_then_becomes_the_program_which_ends_with_the_parent():
    """``python -m areal_async.base.parent PROGRAM``: PROGRAM runs in the wrapper's process (the pid its starter
    holds), without the variable, and ends when the process that named itself its parent is SIGKILLed."""
    program = "import os, time; print(os.getpid(), os.environ.get('AREAL_PARENT_PID'), flush=True); time.sleep(60)"
    middle = textwrap.dedent(
        f"""
        import os, subprocess, sys
        env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
        argv = [sys.executable, "-m", "areal_async.base.parent", sys.executable, "-c", {program!r}]
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)  # the program has started
        os.kill(os.getpid(), 9)
        """
    )
    done = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    started, pid, variable = done.stdout.split()
    assert pid == started and variable == "None"  # exec'd in place; its own children are not named as ours
    assert survivors({int(pid)}, within_s=10) == []


def test_the_wrapper_refuses_no_program_and_names_one_it_cannot_run():
    wrapper = [sys.executable, "-m", "areal_async.base.parent"]
    done = subprocess.run(wrapper, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage: python -m areal_async.base.parent PROGRAM" in done.stderr
    done = subprocess.run([*wrapper, "/nonexistent/program", "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 127 and "cannot run '/nonexistent/program'" in done.stderr
