"""The fork server's own process: imports the trainer's and rollout worker's modules once, then forks a
child per request that runs ``python -m workers.<role> ARGS`` from there (``forkserver.py`` is the
supervisor's side and says when it is used).

    python -m areal_async.supervisor.zygote PRELOAD[,PRELOAD...] [--room XXXX...]

Why: those two roles spend ~3.5 s of CPU each importing torch and transformers (measured with
``python -X importtime``, quiet 2-core machine) before they do anything; a fleet with a trainer and
two rollout workers paid it three times, on two cores, on the way to its first generated token. A
child forked here has them already, as a ``torch.utils.data.DataLoader`` worker forked from a process
that imported torch has (the same condition holds: no CUDA context and no torch thread pool exists
at the fork; nothing here runs a tensor op).

The pipe (length-prefixed typed msgpack frames, ``protocols.side``): ``ForkServerReady`` once, then
for each ``ForkRequest`` one ``Forked`` (the pid, or why none started), and a ``ForkExited`` for every
child that ends (reaped here: the supervisor is not their parent). It runs on descriptors moved away
from 0 and 1, which point at /dev/null and stderr, so nothing an import prints can corrupt a frame.
Stdin's EOF (the supervisor closed it, or died) ends this process; its children live on in their
own sessions, as the supervisor's own children would.

A child is what ``python -m MODULE ARGS`` started by ``subprocess.Popen(start_new_session=True)`` with
``env`` in ``cwd`` would be, down to: its own session, stdin /dev/null, stdout and stderr appended to
its log, exactly ``env`` in ``os.environ``, the signal dispositions of a fresh interpreter,
``sys.argv`` and ``/proc/PID/cmdline`` (``ps``, and whoever finds a worker by its ``--worker-id``) of
that command, the garbage collector on, and the interpreter's exit (threads joined, ``atexit`` run, stdio
flushed, the exit status and message from ``SystemExit``). What differs: the preloaded modules are already in
``sys.modules`` (their import-time side effects happened once, here, with the environment this process started
with, which the supervisor gives only the variables every worker shares: ``forkserver.FORKABLE_ENV_DIFF``), the
interpreter's hash seed is this process's, ``sys.orig_argv`` is this process's command line, and the exit skips
the interpreter's teardown (``end_child``: the objects still alive are not finalized).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import runpy
import select
import signal
import sys
import traceback
from typing import Optional

from areal_async.base.parent import parent_env
from areal_async.base.process import exit_without_teardown
from areal_async.reward._wire import encode_frame, read_frame
from protocols.side import ForkExited, Forked, ForkRequest, ForkServerReady

ROOM_FLAG = "--room"  # an argument whose only job is to make room for a child's command line


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    requests, replies = _private_pipe()
    # the recipe of gc.freeze's documentation: no collection in the server (its imports ran ~0.3 s of the
    # ~4.5 s faster with none, and a collection before the freeze took ~0.15 s more: ~9,600 objects of
    # ~590,000 were garbage), the survivors frozen before any fork, the collector enabled in each child
    gc.disable()
    try:
        for name in argv[0].split(",") if argv and argv[0] else []:
            importlib.import_module(name)
    except BaseException as e:  # the supervisor starts these workers the ordinary way and says why
        replies.write(encode_frame(ForkServerReady(ready=False, pid=os.getpid(), error=_one_line(e))))
        replies.flush()
        return 1
    gc.freeze()  # what the children share stays out of every collection: their pages stay shared
    replies.write(encode_frame(ForkServerReady(ready=True, pid=os.getpid())))
    replies.flush()
    child = serve(requests, replies)
    if child is None:  # stdin's EOF: nothing of this process needs finalizing (every frame was flushed)
        os._exit(0)  # the interpreter's teardown of torch would add ~0.1-0.3 s to the run's end
    end_child(run_child(child))  # only in a forked child, after serve() returned in it


class _Exact:
    """A pipe read whole: ``read(n)`` returns n bytes, fewer only at EOF (a raw read may return less;
    a buffered one may read ahead of what ``select`` then sees)."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = os.read(self.fd, n - len(out))
            if not chunk:
                break
            out += chunk
        return out

    def close(self) -> None:
        os.close(self.fd)


def _private_pipe():
    """The request and reply streams on new descriptors; fd 0 becomes /dev/null and fd 1 stderr."""
    requests = _Exact(os.dup(0))
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return requests, replies


def serve(requests, replies) -> Optional[ForkRequest]:
    """Answer requests until stdin's EOF (returns None); in a forked child, return its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of every exit
    own = (requests, replies, wake_r, wake_w)
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(replies)
        if requests not in ready:
            continue
        req = read_frame(requests, ForkRequest)
        if req is None:
            return None
        pid, error = _fork(req, own)
        if pid == 0:
            return req
        replies.write(encode_frame(Forked(name=req.name, pid=pid) if pid > 0 else Forked(name=req.name, error=error)))
        replies.flush()


def _reap(replies) -> None:
    """One ForkExited per child that ended (subprocess's convention: -N when signal N killed it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        replies.write(encode_frame(ForkExited(pid=pid, code=os.waitstatus_to_exitcode(status))))
        replies.flush()


def _fork(req: ForkRequest, own: tuple) -> tuple[int, str]:
    """(the child's pid, ""); (0, "") in the child, its setup done; (-1, why) when none started."""
    if req.argv[:2] != [sys.executable, "-m"] or len(req.argv) < 3:
        return -1, f"not a `{sys.executable} -m MODULE` command: {req.argv[:3]}"
    try:
        log_fd = os.open(req.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        return -1, f"cannot open the log {req.log_path}: {e}"
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(log_fd)
        return -1, f"fork failed: {e}"
    if pid:
        os.close(log_fd)
        return pid, ""
    _become(req, log_fd, own, server)
    return 0, ""


def _become(req: ForkRequest, log_fd: int, own: tuple, server: int) -> None:
    """In the child: the session, descriptors, signals, directory, environment and command line of
    ``req.argv`` started by Popen(start_new_session=True). Any failure here ends the child at once with
    status 1, its reason in its log."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN if sig in req.ignored else signal.SIG_DFL)
        # as a fresh interpreter has it: Python installs its handler only where SIGINT was not ignored at exec
        signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in req.ignored else signal.default_int_handler)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        requests, replies, wake_r, wake_w = own
        requests.close()
        replies.close()  # flushed after every frame: nothing of the server's is written from here
        os.close(wake_r)
        os.close(wake_w)
        os.chdir(req.cwd)
        os.environ.clear()
        os.environ.update(req.env | parent_env(server))  # its parent is this server, not the supervisor
        set_cmdline(req.argv)
        gc.enable()  # as a fresh interpreter has it (disabled in the server: see main)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def run_child(req: ForkRequest) -> int:
    """Run the request's module as ``__main__`` with its arguments; the exit status its ``SystemExit`` gives, as
    the interpreter reads one (another exception propagates: the interpreter prints it and exits 1)."""
    module = req.argv[2]
    sys.argv = req.argv[2:]  # run_module sets argv[0] to the module's file, as `python -m` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return exit_status(e.code)
    return 0


def exit_status(code) -> int:
    """What ``sys.exit(code)`` makes the process's status: None 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_child(code: int) -> None:
    """End a forked child without the interpreter's teardown (``base.process.exit_without_teardown``): the last
    collection and module teardown would free hundreds of thousands of objects whose pages the child shares
    with this server (each free writes a refcount: a copy of the page), ~0.6 s at a run's end (a traced run)."""
    exit_without_teardown(code)


def set_cmdline(argv: list[str]) -> bool:
    """Write ``argv`` over this process's original command line (what /proc/PID/cmdline and ``ps`` show),
    NUL-padded; False (nothing written) where it does not fit or /proc says nothing. The area is the one
    ``setproctitle`` rewrites: the original argv strings, which CPython copied at start-up and never
    reads again."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    # proc(5): fields 48 and 49 are arg_start and arg_end; after the ")" the first field is 3 (state)
    start, end = int(fields[48 - 3]), int(fields[49 - 3])
    data = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    if start == 0 or len(data) > end - start:
        return False
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    return True


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
