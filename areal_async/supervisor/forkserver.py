"""The fork server: trainer and rollout processes forked from one process that imported their modules once.

``areal-async run`` on this machine (``cluster.launcher: local``, ``cluster.device: cpu``,
``cluster.fork_server: true``, the default) starts ``supervisor/zygote.py`` first thing, before the
preflight: it imports ``areal_async.app.workers.trainer_worker`` and ``rollout_worker`` (torch, transformers:
~3.5 s of CPU) and ``scheduler_worker`` (transformers, for the prompts' tokenizer) while the preflight
runs on the other core. ``ForkServerLauncher`` then starts ``workers.scheduler``, ``workers.trainer`` and
``workers.rollout`` as children forked from it, which skip that import; every other process (reward
workers, inference servers) starts as before (``LocalLauncher``), and before them: the supervisor starts
first what it need not wait for (``Launcher.waits``), so a reward worker's checking processes import while
the server still does. Measured: ``benchmarks/startup.py``.

A request is forked only when the child would get what ``python -m`` would give it (``zygote.py`` says
what that covers): the command is ``[sys.executable, "-m", workers.trainer|workers.rollout, ...]``, its
environment differs from the one the server started with only in variables the workers read at run time
(``FORKABLE_ENV_DIFF``: the run's own ``AREAL_*``), and its command line fits the room the server's own
left for it. Otherwise, or when the server failed to import (its reason printed once) or is gone, the
process starts the ordinary way: a fork server can make a start faster, never make one fail.

The supervisor is not the parent of a forked child: the server reaps it and reports its exit status
(``ForkExited``), which ``ForkedProcess.poll`` returns as ``subprocess`` would. Signals go to the child's
process group by pid, as for a local child. If the server itself dies, a child that has ended reports
``EXIT_UNKNOWN``. GPU runs and the Slurm and Ray launchers never use it (not tried: a CUDA context must
not exist before a fork; nothing here creates one, but no GPU run has checked it).
"""

from __future__ import annotations

import os
import signal as signals
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from areal_async.base.cores import WAIT_POLICY_ENV
from areal_async.config import ExperimentConfig
from areal_async.reward._wire import encode_frame, read_frame
from areal_async.supervisor.launchers import Launched, LocalLauncher
from protocols.messages import ProtocolError
from protocols.side import ForkExited, Forked, ForkRequest, ForkServerReady

# the worker module -> what its main() imports after pinning (workers/_main.py): the server imports these
FORKED_MODULES = {
    "workers.scheduler": "areal_async.app.workers.scheduler_worker",
    "workers.trainer": "areal_async.app.workers.trainer_worker",
    "workers.rollout": "areal_async.app.workers.rollout_worker",
}
FORKABLE_ENV_DIFF = ("AREAL_",)  # read by the workers at run time, by no module at import (tests/unit/supervisor)
ROOM = 2048  # bytes of command line a forked child can show (the server's own argument that holds the room)
READY_TIMEOUT_S = 300.0  # the server's imports; a start waits this long for them, then starts the ordinary way
NOT_READY = "not ready in time"
REPLY_TIMEOUT_S = 60.0
# the signals a forked child sets as exec would leave them: ignored where the supervisor ignores them as it
# asks (a run started in the background, or under nohup), else a fresh interpreter's default
CHILD_SIGNALS = (signals.SIGINT, signals.SIGTERM, signals.SIGHUP, signals.SIGCHLD, signals.SIGUSR1, signals.SIGUSR2)
EXIT_UNKNOWN = 255  # a forked child that ended after its server died: its status is lost


def worker_env(cfg: ExperimentConfig) -> dict[str, str]:
    """The environment every worker process starts from (``Supervisor.start_all`` adds ``AREAL_T0``); the fork
    server starts with it too, so that what the OpenMP runtime reads at load (``OMP_*``) is the workers'."""
    env = dict(
        os.environ, OMP_NUM_THREADS=str(cfg.cluster.torch_threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )
    if cfg.cluster.share_cores:  # idle OpenMP threads must sleep, not spin (base/cores.py)
        env = WAIT_POLICY_ENV | env
    if cfg.cluster.malloc_arenas > 0:  # read by glibc at its first malloc: the fork server's arenas count too
        env = {"MALLOC_ARENA_MAX": str(cfg.cluster.malloc_arenas)} | env
    return env


def wants_fork_server(cfg: ExperimentConfig) -> bool:
    cl = cfg.cluster
    return cl.fork_server and cl.launcher == "local" and cl.device == "cpu" and cfg.mode != "train_only"


def start_fork_server(cfg: ExperimentConfig) -> Optional["ForkServer"]:
    """The run's fork server, importing already (None where ``wants_fork_server`` says no)."""
    return ForkServer(worker_env(cfg), sorted(set(FORKED_MODULES.values()))) if wants_fork_server(cfg) else None


class ForkError(RuntimeError):
    """The server could not start a process (the launcher then starts it the ordinary way)."""


class ForkServer:
    """The supervisor's handle on ``zygote.py``: one request at a time; a reader thread takes the replies."""

    def __init__(self, env: dict[str, str], preload: list[str]):
        self.env, self.cwd = dict(env), os.getcwd()
        self.argv = [sys.executable, "-m", "areal_async.supervisor.zygote", ",".join(preload), "--room", "x" * ROOM]
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=self.env,
            start_new_session=True,
        )  # fmt: skip
        self._cond = threading.Condition()
        self._ready: Optional[ForkServerReady] = None
        self._replies: list[Forked] = []
        self._codes: dict[int, int] = {}
        self._gone: Optional[str] = None  # why the pipe ended
        self._lock = threading.Lock()  # one request in flight
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def _read(self) -> None:
        why = "it exited"
        try:
            while (m := read_frame(self.proc.stdout, (ForkServerReady, Forked, ForkExited))) is not None:
                with self._cond:
                    if isinstance(m, ForkServerReady):
                        self._ready = m
                    elif isinstance(m, Forked):
                        self._replies.append(m)
                    else:
                        self._codes[m.pid] = m.code
                    self._cond.notify_all()
        except (ProtocolError, OSError, ValueError) as e:
            why = f"its pipe broke: {e}"
        with self._cond:
            self._gone = why
            self._cond.notify_all()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Optional[str]:
        """None once the server has imported its modules; else why it cannot fork."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None or self._gone is not None, timeout)
            if self._ready is not None:
                return None if self._ready.ready else f"its imports failed ({self._ready.error})"
            return f"the fork server is gone ({self._gone}){self._stderr_tail()}" if self._gone else NOT_READY

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f": {lines[-1]}" if lines else ""

    def forkable(self, cmd: list[str], env: dict[str, str]) -> Optional[str]:
        """None when ``cmd`` with ``env`` can be forked; else why not ("" for a command it never serves)."""
        if cmd[:2] != [sys.executable, "-m"] or len(cmd) < 3 or cmd[2] not in FORKED_MODULES:
            return ""
        keys = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        other = sorted(k for k in keys if not k.startswith(FORKABLE_ENV_DIFF))
        if other:
            return f"its environment differs from the fork server's in {other[:3]}"
        if sum(len(os.fsencode(a)) + 1 for a in cmd) > sum(len(os.fsencode(a)) + 1 for a in self.argv):
            return "its command line is longer than the fork server's room for it"
        return None

    def fork(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> int:
        """The pid of ``cmd`` forked as ``name``; ForkError if none started."""
        ignored = [int(s) for s in CHILD_SIGNALS if signals.getsignal(s) == signals.SIG_IGN]
        req = ForkRequest(
            name=name, argv=list(cmd), env=dict(env), cwd=self.cwd, log_path=str(log_path), ignored=ignored
        )
        with self._lock:
            try:
                self.proc.stdin.write(encode_frame(req))
                self.proc.stdin.flush()
            except OSError as e:
                raise ForkError(f"the fork server is gone ({e})") from e
            with self._cond:
                if not self._cond.wait_for(lambda: self._replies or self._gone is not None, REPLY_TIMEOUT_S):
                    raise ForkError(f"no reply from the fork server in {REPLY_TIMEOUT_S:.0f} s")
                if not self._replies:
                    raise ForkError(f"the fork server is gone ({self._gone})")
                reply = self._replies.pop(0)
        if reply.name != name or reply.pid is None:
            raise ForkError(reply.error or f"the fork server answered for {reply.name!r}, not {name!r}")
        return reply.pid

    def returncode(self, pid: int) -> Optional[int]:
        with self._cond:
            if pid in self._codes:
                return self._codes[pid]
            if self._gone is not None and not _alive(pid):
                self._codes[pid] = EXIT_UNKNOWN
                return EXIT_UNKNOWN
            return None

    def wait(self, pid: int, timeout: Optional[float]) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._codes or self._gone is not None, timeout):
                raise subprocess.TimeoutExpired(f"pid {pid}", timeout)
        while (code := self.returncode(pid)) is None:  # the server is gone: poll the orphan
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {pid}", timeout)
            time.sleep(0.05)
        return code

    def close(self) -> None:
        """End the server: stdin's EOF once it is ready (SIGKILL after 5 s); its children are not touched. A
        server still importing has forked nothing and reads no EOF until its imports end (seconds; a refused
        run waited the whole 5 s for it): SIGKILL at once."""
        with self._cond:
            importing = self._ready is None and self._gone is None
        if importing and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class ForkedProcess(Launched):
    """A child of the fork server, watched and stopped like a local child (its own session)."""

    on_this_machine = True

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> Optional[int]:  # type: ignore[override]
        return self.server.returncode(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.server.wait(self.pid, timeout)

    def signal(self, sig: int) -> None:
        """``sig`` to the child's process group. The server answers as soon as it has forked, so the child may
        not lead its group yet (``setsid`` is its first step, ``zygote._become``): then the group does not exist
        and the signal goes to the child itself, which has started nothing of its own by then. (Popen has no such
        window: it returns after the exec, long after the setsid.)"""
        if self.poll() is not None and sig == signals.SIGTERM:  # as LocalProcess: SIGKILL still reaches its group
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            if self.poll() is None:  # alive, not yet a group leader (not reaped: its pid is still its own)
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass


class ForkServerLauncher(LocalLauncher):
    """Local children; those the server can fork (``ForkServer.forkable``) are forked from it."""

    def __init__(self, server: ForkServer):
        self.server = server
        self.told: set[str] = set()
        self.interrupted = False

    def interrupt(self) -> None:
        self.interrupted = True

    def waits(self, cmd: list[str], env: dict) -> bool:
        """True for a command the server would fork: its start waits for the server's imports."""
        return self.server.forkable(cmd, env) is None

    def start(self, name: str, cmd: list[str], env: dict, log_path: Path, node: int = 0) -> Launched:
        why = self.server.forkable(cmd, env)
        if why is None:
            why = self._ready()
        if why is None:
            try:
                return ForkedProcess(self.server, self.server.fork(name, cmd, env, log_path))
            except ForkError as e:
                why = str(e)
        if why and why not in self.told:  # said once per reason, never for the processes it does not serve
            self.told.add(why)
            print(f"areal-async: warning: fork server: {why}; {name} starts with a fresh interpreter", file=sys.stderr)
        return super().start(name, cmd, env, log_path, node)

    def _ready(self, timeout: float = READY_TIMEOUT_S) -> Optional[str]:
        """``ForkServer.wait_ready`` in 0.1 s slices: a signal to the run (``interrupt``) ends the wait, so a
        run stopped while the server still imports (a loaded machine: minutes) stops at once, as without it."""
        deadline = time.monotonic() + timeout
        while (why := self.server.wait_ready(0.1)) == NOT_READY and not self.interrupted:
            if time.monotonic() >= deadline:
                return why
        return "the run is stopping" if why == NOT_READY else why

    def close(self) -> None:
        self.server.close()
