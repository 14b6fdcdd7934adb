"""The launcher seam: how the supervisor starts, watches and stops one process.

``Launcher.start(name, cmd, env, log_path, node)`` starts ``cmd`` with ``env`` (stdout and stderr
appended to ``log_path``) on node ``node`` of the run and returns a ``Launched`` handle, which
the supervisor watches (``poll`` / ``wait`` / ``returncode``) and stops (``signal``: the process
and everything it started). The supervisor's rules (restart, fail loudly, stop on a signal) are
written once against this seam, so they carry over to every backend:

- ``local``: a child process of the supervisor in its own session (its process group is what
  ``signal`` reaches);
- ``slurm`` (inside an allocation): one ``srun`` step per process, on the node the placement
  names (``supervisor/slurm.py``); ``signal`` reaches the local ``srun``, which forwards it to
  the step, and the step ends with it;
- ``ray``: one Ray actor per process, holding it (``supervisor/ray_launcher.py``).

Exit codes follow ``subprocess``: >= 0 an exit status, < 0 killed by that signal.
"""

from __future__ import annotations

import os
import signal as signals
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional

from areal_async.base.parent import parent_env


class Launched(ABC):
    """One started process: watched and stopped by the supervisor."""

    pid: int  # the process id on its node (for logs and pids.json)
    returncode: Optional[int] = None
    on_this_machine: bool = False  # a pid of this machine (signals, /proc, the hang capture reach it)

    @abstractmethod
    def poll(self) -> Optional[int]:
        """The exit code once it ended, else None."""

    @abstractmethod
    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until it ends (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""

    @abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process and everything it started (nothing if it is gone)."""


class Launcher(ABC):
    """Starts processes of one run; ``close`` releases what the backend holds (not the processes)."""

    name: str = ""

    @abstractmethod
    def start(self, name: str, cmd: list[str], env: dict, log_path: Path, node: int = 0) -> Launched:
        """Start ``cmd`` as worker ``name`` on node ``node``."""

    def node_address(self, name: str) -> Optional[str]:
        """The address of the node worker ``name`` will run on, when the backend decides it (Ray places
        bundles itself; Slurm names the allocation's nodes); None: the config's (``cluster.node_hosts``)."""
        return None

    def waits(self, cmd: list[str], env: dict) -> bool:
        """Whether starting ``cmd`` may wait for the backend (the fork server's imports): the supervisor starts
        such processes after those that start at once."""
        return False

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Release the backend's resources (called once the run's processes are stopped)."""

    def interrupt(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """The run is being stopped (the supervisor got SIGINT/SIGTERM; called from its signal handler): a
        ``start`` that waits on the backend stops waiting. Only sets a flag: it may run inside a wait."""


class LocalProcess(Launched):
    """A ``subprocess.Popen`` that leads its own session: ``signal`` reaches its whole process group."""

    on_this_machine = True

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> Optional[int]:  # type: ignore[override]
        return self.proc.returncode

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.proc.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is not None and sig == signals.SIGTERM:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own session/group: start_new_session=True
        except ProcessLookupError:
            pass


def popen_logged(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """``cmd`` in a new session, stdout+stderr appended to ``log_path``, no stdin."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )


class LocalLauncher(Launcher):
    """Child processes of the supervisor on this machine (every node is this machine)."""

    name = "local"

    def start(self, name: str, cmd: list[str], env: dict, log_path: Path, node: int = 0) -> Launched:
        named = (os.environ if env is None else env) | parent_env()  # it ends with us (base/parent.py)
        return LocalProcess(popen_logged(cmd, named, log_path))
