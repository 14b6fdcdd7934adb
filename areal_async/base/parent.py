"""A worker ends with the process that started it (Linux ``PR_SET_PDEATHSIG``).

A worker runs in a session of its own (the supervisor signals its process group), so what reaches the
supervisor never reaches it. A supervisor killed outright (SIGKILL, the OOM killer) stops nobody: its workers
would run on unwatched, holding their ports, memory and accelerators, with nobody to restart, stop or reap them.
So the launcher names the worker's parent in ``AREAL_PARENT_PID`` (the supervisor, for a process it starts; the
fork server, for one it forks: the fork server itself ends when the supervisor's end of its pipe closes), and
``die_with_parent`` asks Linux to send this process SIGTERM when that parent ends (a worker unwinds on SIGTERM:
``app/workers/worker.py``), or sends it at once if the parent has ended already. Without the variable (Ray,
Slurm, a worker started by hand) or off Linux it does nothing.

Linux ties the request to the parent's *thread* that forked: the supervisor starts its processes from its main
thread, the fork server forks from its only one.

A program that does not call ``die_with_parent`` itself (``sglang.launch_server`` on a GPU machine) is started
through ``python -m areal_async.base.parent PROGRAM ARGS...``: the request is made, then PROGRAM is exec'd in
the same process (same pid; the request survives exec, Linux clears it only for set-user-ID programs), before
any of its own imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "AREAL_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_env(pid: int | None = None) -> dict[str, str]:
    """The variable a launcher adds to a child's environment: ``pid`` (default: this process) is its parent."""
    return {PARENT_ENV: str(os.getpid() if pid is None else pid)}


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """``sig`` to this process when the parent ``AREAL_PARENT_PID`` names ends (now, if it already has);
    whether the request was made. The variable is taken out of the environment: what this process starts
    is not named as a child of its parent."""
    want = os.environ.pop(PARENT_ENV, "")
    if not want.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        made = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if made and os.getppid() != int(want):  # it ended before the request (this process was re-parented)
        os.kill(os.getpid(), sig)
    return made


USAGE = "usage: python -m areal_async.base.parent PROGRAM [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    """Ask to end with ``AREAL_PARENT_PID``'s process (``die_with_parent``), then exec ``argv`` (looked up on
    PATH) in this process; 2 with the usage on stderr when there is no program, 127 when it cannot be exec'd."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    die_with_parent()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"areal_async.base.parent: cannot run {argv[0]!r}: {e}", file=sys.stderr)
        return 127
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
