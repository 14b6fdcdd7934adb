"""A pool of killable reward processes: a hung check is SIGKILLed at its deadline and scores 0.

Why processes and not threads: some completions make sympy run for minutes inside C code that
holds the GIL (power towers like ``9^{9^{9^{9}}}``, huge factorials); a thread stuck there
cannot be interrupted and starves every other thread of the worker (heartbeats, ZeroMQ I/O).
math-verify's own timeout uses ``signal.alarm``, which only works in a main thread, and a Python
signal handler cannot run until the C call returns anyway. So each check runs in the MAIN
thread of a child process (math-verify's timeouts off), and the parent enforces the deadline the
only way that always works: SIGKILL the child, reap it, start a replacement.

Covered:
- ``RewardPool(fn, n_procs, timeout_s, fn_kwargs)`` or ``RewardPool.from_config(RewardConfig)``:
  ``score`` / ``score_many`` (asyncio: the blocking pipe waits run in the pool's own thread
  executor, so a uvloop/asyncio loop is never blocked), ``score_sync``, ``close``; sync and
  async context manager.
- Outcomes: ``ok``; ``timeout`` (child killed, score 0); ``error`` (the function raised, returned
  a non-number, or the child died; score 0). A raising function keeps its child; a dead or
  killed child is replaced at once, so the pool stays at ``n_procs``.
- Children are fresh interpreters (``subprocess``, not fork: the parent may hold torch / ZeroMQ
  threads), import only ``msgpack``, ``protocols.side`` and the reward function's module (never
  torch), and talk typed msgpack frames over stdin/stdout (see ``_child.py``), never pickle. One
  task per child at a time; ``score_many`` deals a group round-robin into one share per child and
  sends a share as one ``RewardTasks`` frame (a round trip per child, not per sample); the child
  writes one reply per check as it ends, and the parent reads them check by check so each keeps
  its own deadline. A score reply's bytes repeat (0.0, 1.0), so the child encodes and the parent
  decodes each distinct one once.
- No zombies or orphans: ``close()`` (also at interpreter exit, via atexit) kills and reaps every
  child; a child exits by itself when its stdin closes or its parent dies.

- Memory: with ``memory_limit_mb`` > 0 each child caps its address space (RLIMIT_AS) once the
  function is loaded; a check that allocates past it fails with ``MemoryError`` (status
  ``error``, score 0) and the child lives on (or, if it dies, is replaced), instead of pushing
  the machine into swap or the OOM killer.

Not covered: retrying a timed-out check (a timeout is a verdict: score 0), cancelling a running
check from asyncio (a cancelled ``score`` still occupies its child until the check ends or times
out).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


from areal_async.base.plugins import load_callable
from areal_async.reward._wire import HEADER, encode_frame
from areal_async.reward.judge import JUDGE_FN, judge_kwargs
from protocols.messages import SideMessage, decode
from protocols.side import RewardInit, RewardReady, RewardReply, RewardTasks

__all__ = ["RewardOutcome", "RewardPool", "DEFAULT_REWARD_FN"]

logger = logging.getLogger(__name__)

DEFAULT_REWARD_FN = "areal_async.reward.math_verify_reward:boxed_math_reward"
_MAX_FRAME = 64 << 20  # a reply is a few bytes; anything this big means a corrupt stream
_REAP_TIMEOUT_S = 5.0
_READ_CHUNK = 1 << 16  # bytes asked of a child's pipe per read: every reply it has written so far
_MAX_CACHED_REPLIES = 1024  # distinct score replies remembered (decoded once each)
_SCORE_REPLIES: dict[bytes, "RewardOutcome"] = {}  # reply body -> its outcome (elapsed_s 0)


@dataclass
class RewardOutcome:
    """Result of one check. ``score`` is 0.0 unless ``status == "ok"``."""

    score: float
    status: str  # "ok" | "timeout" | "error"
    detail: str = ""
    elapsed_s: float = 0.0


class _Timeout(Exception):
    pass


class _ChildSpec:
    """How to start a child: command line, environment (parent's sys.path), init frame."""

    def __init__(self, fn: str, fn_kwargs: dict, memory_limit_mb: int = 0):
        self.argv = [sys.executable, "-m", "areal_async.reward._child", str(os.getpid())]
        self.env = dict(os.environ)
        # The child must import exactly what the parent can (e.g. test helpers on pytest's path).
        paths = [os.path.abspath(p) for p in sys.path if isinstance(p, str)]
        self.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self.init_frame = encode_frame(RewardInit(fn=fn, kwargs=fn_kwargs, memory_limit_mb=memory_limit_mb))

    def start(self) -> subprocess.Popen:
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, bufsize=0)
        # Non-blocking writes so a child that stops reading can't hold us past a deadline.
        os.set_blocking(proc.stdin.fileno(), False)
        return proc


class _Slot:
    """One child process. Only the thread that took this slot from the idle queue does pipe I/O;
    ``lock`` guards replacing the process against a concurrent ``shutdown``."""

    def __init__(self, spec: _ChildSpec, timeout_s: float, startup_timeout_s: float):
        self.spec, self.timeout_s, self.startup_timeout_s = spec, timeout_s, startup_timeout_s
        self.lock = threading.Lock()
        self.closed = self.busy = self.ready = False
        self.proc: subprocess.Popen | None = None
        self._spawn()

    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(self, items: list[tuple[str, list[str]]]) -> list[RewardOutcome]:
        """Score ``items`` in this child (one frame out, one reply per item); a check that times
        out or kills the child scores alone, and the rest go on in its replacement."""
        outs: list[RewardOutcome] = []
        while len(outs) < len(items):
            with self.lock:
                if self.closed:
                    return outs + [RewardOutcome(0.0, "error", "reward pool is closed")] * (len(items) - len(outs))
                proc, self.busy = self.proc, True
            try:
                failed = self._ready_or_error(proc)
                outs += [failed] if failed else self._check(proc, items[len(outs) :])
            finally:
                with self.lock:
                    self.busy = False
                    if self.closed:
                        _close_pipes(proc)
        return outs

    def shutdown(self) -> None:
        with self.lock:
            self.closed = True
            if self.proc is not None:
                _kill(self.proc)
                if not self.busy:  # a busy thread still reads these pipes; it closes them itself
                    _close_pipes(self.proc)
                self.proc = None

    def _spawn(self) -> None:
        self.proc, self.ready = self.spec.start(), False
        self.rbuf = bytearray()  # bytes read from this child past its last reply frame
        _write_frame(self.proc, self.spec.init_frame, time.monotonic() + self.startup_timeout_s)

    def _ready_or_error(self, proc) -> RewardOutcome | None:
        """None once the child has loaded the function; else an error outcome (child replaced)."""
        if self.ready:
            return None
        t0 = time.monotonic()
        try:
            msg = _read_frame(proc, t0 + self.startup_timeout_s, RewardReady, self.rbuf)
        except (_Timeout, EOFError, OSError, ValueError) as e:
            msg = RewardReady(ready=False, error=f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if msg.ready:
            self.ready = True
            return None
        self._replace(proc)
        detail = f"reward process pid {proc.pid} failed to start: {msg.error}"
        return RewardOutcome(0.0, "error", detail, time.monotonic() - t0)

    def _check(self, proc, items: list[tuple[str, list[str]]]) -> list[RewardOutcome]:
        """Outcomes of ``items`` in order, up to and including the first one that timed out or
        lost the child (which is then replaced). Each check has its own ``timeout_s``, counted
        from the previous reply."""
        outs = []
        t0 = time.monotonic()
        try:
            tasks = RewardTasks(
                completions=[it[0] for it in items],
                solutions=[list(it[1]) for it in items],
                prompts=[it[2] for it in items] if len(items[0]) > 2 else None,  # questions, when given
            )
            _write_frame(proc, encode_frame(tasks), t0 + self.timeout_s)
            for _ in items:
                outcome = _reply_outcome(_read_body(proc, t0 + self.timeout_s, self.rbuf))
                now = time.monotonic()
                outs.append(RewardOutcome(outcome.score, outcome.status, outcome.detail, now - t0))
                t0 = now
        except _Timeout:
            self._replace(proc)
            logger.warning("reward check killed at its %.3g s timeout (pid %d)", self.timeout_s, proc.pid)
            detail = f"killed pid {proc.pid} after {self.timeout_s:g} s"
            outs.append(RewardOutcome(0.0, "timeout", detail, time.monotonic() - t0))
        except (EOFError, OSError, ValueError) as e:
            code = self._replace(proc)
            detail = f"reward process pid {proc.pid} died (exit code {code}): {type(e).__name__} {e}".rstrip()
            outs.append(RewardOutcome(0.0, "error", detail, time.monotonic() - t0))
        return outs

    def _replace(self, proc) -> int | None:
        """Kill and reap ``proc``; start a replacement unless the pool is closing."""
        with self.lock:
            code = _kill(proc)
            _close_pipes(proc)
            if self.proc is proc and not self.closed:
                self._spawn()
        return code


def _reply_outcome(body: bytes) -> RewardOutcome:
    """The outcome a reply body stands for (``elapsed_s`` 0: the caller times it). A score reply's
    body decodes once per pool process: scores repeat (0.0, 1.0), and so do their bytes."""
    outcome = _SCORE_REPLIES.get(body)
    if outcome is not None:
        return outcome
    reply = decode(body, (RewardReply,))  # checks the type: exactly one of score and error
    if reply.error is not None:
        return RewardOutcome(0.0, "error", reply.error)
    outcome = RewardOutcome(float(reply.score), "ok")
    if len(_SCORE_REPLIES) < _MAX_CACHED_REPLIES:
        _SCORE_REPLIES[body] = outcome
    return outcome


def _kill(proc: subprocess.Popen) -> int | None:
    """SIGKILL and reap; returns the exit code (negative: killed by that signal)."""
    if proc.poll() is None:
        proc.kill()
    try:
        return proc.wait(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.error("reward process pid %d did not die %g s after SIGKILL", proc.pid, _REAP_TIMEOUT_S)
        return None


def _close_pipes(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        stream.close()  # idempotent


def _write_frame(proc, frame: bytes, deadline: float) -> None:
    fd, view = proc.stdin.fileno(), memoryview(frame)
    while view:
        _wait(fd, select.POLLOUT, deadline)
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


def _read_frame(proc, deadline: float, expect: type[SideMessage], buf: bytearray | None = None) -> SideMessage:
    """The child's next reply as an ``expect``; ValueError (``ProtocolError``) if it is not one."""
    return decode(_read_body(proc, deadline, buf), (expect,))


def _read_body(proc, deadline: float, buf: bytearray | None = None) -> bytes:
    """The body of the child's next frame. ``buf``: bytes already read from this child past the
    previous frame (its slot's read buffer); a read takes whatever the pipe holds, so replies
    written back to back cost one wakeup."""
    fd, buf = proc.stdout.fileno(), bytearray() if buf is None else buf
    _fill(fd, buf, HEADER.size, deadline)
    (n,) = HEADER.unpack_from(buf)
    if n > _MAX_FRAME:
        raise ValueError(f"reply frame of {n} bytes from pid {proc.pid}; expected < {_MAX_FRAME}")
    end = HEADER.size + n
    _fill(fd, buf, end, deadline)
    body = bytes(buf[HEADER.size : end])
    del buf[:end]
    return body


def _fill(fd: int, buf: bytearray, n: int, deadline: float) -> None:
    """Read from ``fd`` into ``buf`` until it holds at least ``n`` bytes (more if the pipe has them)."""
    while len(buf) < n:
        _wait(fd, select.POLLIN, deadline)
        chunk = os.read(fd, max(n - len(buf), _READ_CHUNK))
        if not chunk:
            raise EOFError("pipe closed")
        buf += chunk


def _wait(fd: int, events: int, deadline: float) -> None:
    """Block until ``fd`` is ready (or hung up) or raise ``_Timeout`` at ``deadline``.
    poll, not select: select breaks on fd numbers >= 1024, common in a busy worker."""
    poller = select.poll()
    poller.register(fd, events)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Timeout()
        if poller.poll(math.ceil(remaining * 1000)):
            return


class RewardPool:
    """``n_procs`` killable child processes running the reward function ``fn`` (dotted path).

    ``fn(completion: str, solutions: list[str], **fn_kwargs) -> float`` runs in a child's main
    thread; a check running past ``timeout_s`` is killed and scores 0 with status ``"timeout"``.
    An item may carry its question (``(completion, solutions, prompt)``): a batch fn (the judge) gets the
    questions as ``prompts=``; a plain fn never sees them.
    """

    def __init__(
        self,
        fn: str = DEFAULT_REWARD_FN,
        n_procs: int = 1,
        timeout_s: float = 5.0,
        fn_kwargs: dict | None = None,
        *,
        startup_timeout_s: float = 60.0,
        memory_limit_mb: int = 0,
    ):
        _check_args(n_procs, timeout_s, startup_timeout_s, memory_limit_mb)
        load_callable(fn)  # a bad path fails here, in the caller, not later in every child
        spec = _child_spec(fn, fn_kwargs, memory_limit_mb)
        self.fn, self.n_procs, self.timeout_s = fn, n_procs, float(timeout_s)
        self._closed = False
        self._slots = [_Slot(spec, self.timeout_s, startup_timeout_s) for _ in range(n_procs)]
        self._idle: "queue.SimpleQueue[_Slot]" = queue.SimpleQueue()
        for slot in self._slots:
            self._idle.put(slot)
        self._executor = ThreadPoolExecutor(n_procs, thread_name_prefix="reward-pool")
        _LIVE_POOLS.add(self)

    @classmethod
    def from_config(cls, cfg) -> "RewardPool":
        """Build from a ``RewardConfig``; ``cfg.precision`` goes to ``fn`` if it takes
        ``precision`` (or ``**kwargs``), so a plug-in without that knob still loads."""
        judge = judge_kwargs(cfg)
        fn = JUDGE_FN if judge is not None else cfg.fn
        fn_kwargs = {"precision": cfg.precision} if _accepts(load_callable(fn), "precision") else {}
        return cls(
            fn,
            n_procs=cfg.n_procs,
            timeout_s=cfg.timeout_s,
            fn_kwargs=judge if judge is not None else fn_kwargs,
            memory_limit_mb=cfg.memory_limit_mb,
            startup_timeout_s=cfg.judge_startup_s if judge is not None else 60.0,
        )

    def pids(self) -> list[int]:
        """Pids of the live children (for monitoring and tests)."""
        return [pid for pid in (slot.pid() for slot in self._slots) if pid is not None]

    def score_sync(self, completion: str, solutions: list[str], prompt: str | None = None) -> RewardOutcome:
        """Score one completion, blocking the calling thread (at most ~timeout_s once a child is free)."""
        self._check_open()
        item = _item(completion, solutions, prompt)
        return self._score_blocking([item])[0]

    async def score(self, completion: str, solutions: list[str], prompt: str | None = None) -> RewardOutcome:
        """Score one completion (with its question ``prompt``, for a judge) without blocking the event loop."""
        self._check_open()
        item = _item(completion, solutions, prompt)
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(self._executor, self._score_blocking, [item]))[0]

    async def score_many(self, items: list[tuple]) -> list[RewardOutcome]:
        """Score ``(completion, solutions)`` pairs (or ``(completion, solutions, prompt)`` triples, all of one
        kind) over all children; results in input order.

        The items are dealt round-robin into one share per child (at most ``n_procs``), and each
        share goes to its child as one frame: a group costs a round trip per child, not per
        sample. Timeouts stay per check (see ``_Slot.run``)."""
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"items must be a list of (completion, solutions) pairs, got {type(items).__name__}")
        size = len(items[0]) if items and isinstance(items[0], (list, tuple)) else 2
        for item in items:
            if not (isinstance(item, (list, tuple)) and len(item) == size in (2, 3)):
                raise TypeError(
                    f"each item must be a (completion, solutions) pair or, all of them, a (completion, solutions, "
                    f"prompt) triple, got {item!r:.80}"
                )
            _check_item(*item)
        self._check_open()
        k = min(self.n_procs, len(items))
        loop = asyncio.get_running_loop()
        shares = await asyncio.gather(
            *(loop.run_in_executor(self._executor, self._score_blocking, list(items[i::k])) for i in range(k))
        )
        out: list[RewardOutcome] = [None] * len(items)  # type: ignore[list-item]
        for i, share in enumerate(shares):
            out[i::k] = share
        return out

    def close(self) -> None:
        """Kill and reap every child. Idempotent; checks in flight end with status "error"."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            slot.shutdown()
        self._executor.shutdown(wait=False)
        _LIVE_POOLS.discard(self)

    def _score_blocking(self, items: list[tuple[str, list[str]]]) -> list[RewardOutcome]:
        slot = self._idle.get()  # waits while every child is busy: one task per child
        try:
            return slot.run(items)
        finally:
            self._idle.put(slot)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RewardPool({self.fn!r}) is closed")

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "RewardPool":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pids={self.pids()}"
        return f"RewardPool(fn={self.fn!r}, n_procs={self.n_procs}, timeout_s={self.timeout_s:g}, {state})"


def _check_args(n_procs, timeout_s, startup_timeout_s, memory_limit_mb) -> None:
    if isinstance(n_procs, bool) or not isinstance(n_procs, int) or n_procs < 1:
        raise ValueError(f"n_procs must be an int >= 1, got {n_procs!r}")
    for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 0:
        raise ValueError(f"memory_limit_mb must be an int >= 0 (0 = no limit), got {memory_limit_mb!r}")


def _child_spec(fn: str, fn_kwargs, memory_limit_mb: int = 0) -> _ChildSpec:
    if fn_kwargs is not None and not isinstance(fn_kwargs, dict):
        raise TypeError(f"fn_kwargs must be a dict or None, got {type(fn_kwargs).__name__}: {fn_kwargs!r:.80}")
    try:
        return _ChildSpec(fn, dict(fn_kwargs or {}), memory_limit_mb)
    except (TypeError, ValueError) as e:  # msgpack refuses it: it could never reach the child
        raise ValueError(
            f"fn_kwargs must be msgpack-serialisable (str keys, plain values), got {fn_kwargs!r:.200}: {e}"
        ) from e


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass nothing extra
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _check_item(completion, solutions, prompt: str = "") -> None:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}: {completion!r:.80}")
    if not isinstance(solutions, (list, tuple)) or not all(isinstance(s, str) for s in solutions):
        raise TypeError(f"solutions must be a list of str, got {solutions!r:.80}")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}: {prompt!r:.80}")


def _item(completion, solutions, prompt) -> tuple:
    _check_item(completion, solutions, "" if prompt is None else prompt)
    return (completion, solutions) if prompt is None else (completion, solutions, prompt)


_LIVE_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    """Kill the children of pools nobody closed, so an exiting worker leaves no orphans."""
    for pool in list(_LIVE_POOLS):
        pool.close()
