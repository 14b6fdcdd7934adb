"""Entry point of one reward child process (``python -m areal_async.reward._child PARENT_PID``).

Protocol, msgpack frames (see ``_wire.py``; the typed messages of ``protocols.side``) over the
child's stdin/stdout, never pickle, one task at a time:

    parent -> child  RewardInit  {"fn": "mod:func", "kwargs": {...}, "memory_limit_mb": N}   once, first
    child  -> parent RewardReady {"ready": true, "pid": ...} | {"ready": false, "error": "..."}
    parent -> child  RewardTasks {"completions": ["...", ...], "solutions": [["..."], ...]}  repeated
                                 (+ "prompts": ["...", ...]: the questions, when the pool was given them)
    child  -> parent RewardReply {"score": 1.0} | {"error": "..."}   one per completion, in order

The pool sends a share of checks in one frame; each reply is written (and flushed) as soon as
its check ends, so the parent times every check on its own and a hung one is killed alone.
A frame that is not a valid ``RewardTasks`` is answered with one error reply naming the
problem; the child keeps serving (the length prefix keeps the stream in step).

The reward function runs in this process's MAIN thread. The child exits when its stdin closes
(the parent closed the pool or died); a watchdog thread also exits it when it is re-parented
(parent killed) so a long check cannot outlive the pool. The parent enforces timeouts by
SIGKILL, so nothing here tries to be interruptible.
Imports are kept minimal on purpose: no torch, no zmq — only what the reward function imports. A function
with ``prepare`` (``reward.judge``) is prepared once before the memory cap (its model loaded), and one with
``batch`` is called once per frame (``fn.batch(completions, solutions[, prompts=...])``: one value or exception
each); its first reply then comes when the whole frame is judged, so the frame has the first check's deadline.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import struct
import sys
import threading
import time

from areal_async.base.plugins import load_callable
from areal_async.reward._wire import encode_frame, read_frame
from protocols.messages import ProtocolError
from protocols.side import RewardInit, RewardReady, RewardReply, RewardTasks

_WATCHDOG_PERIOD_S = 1.0


def _protocol_streams():
    """Take stdin/stdout for the protocol; route fd 1 to stderr so a print() can't corrupt it."""
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    return proto_in, proto_out


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # parent is gone: nobody will read our result
        time.sleep(_WATCHDOG_PERIOD_S)


def _run_one(fn, kwargs: dict, completion: str, solutions: list[str]) -> RewardReply:
    try:
        value = fn(completion, solutions, **kwargs)
    except Exception as e:  # the reward fn's bug becomes an "error" outcome; this child lives on
        return RewardReply(error=f"{type(e).__name__}: {e}"[:2000])
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        kind = type(value).__name__
        return RewardReply(error=f"reward function returned {value!r:.200} ({kind}); expected a finite real number")
    return RewardReply(score=float(value))


def _run_batch(fn, kwargs: dict, completions: list, solutions: list, prompts=None) -> list[RewardReply]:
    """``fn.batch``'s results as replies: a number is a score, an exception (returned or raised) an error.
    ``prompts`` (the questions, when the frame carries them) go to it as ``prompts=``."""
    try:
        values = fn.batch(completions, solutions, **kwargs, **({} if prompts is None else {"prompts": prompts}))
    except Exception as e:  # the whole frame failed: each check says so
        values = [e] * len(completions)
    if not isinstance(values, list) or len(values) != len(completions):
        bad = RuntimeError(f"{fn.__name__}.batch returned {values!r:.100}; expected one value a completion")
        values = [bad] * len(completions)
    out = []
    for v in values:
        if isinstance(v, Exception):
            out.append(RewardReply(error=f"{type(v).__name__}: {v}"[:2000]))
        elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out.append(RewardReply(score=float(v)))
        else:
            out.append(RewardReply(error=f"{fn.__name__}.batch gave {v!r:.100}; expected a finite real number"))
    return out


def _load(proto_in):
    """(fn, kwargs, ready message) from the init message."""
    try:
        init = read_frame(proto_in, RewardInit)
    except ProtocolError as e:
        return None, None, RewardReady(ready=False, error=f"bad init message: {e}")
    if init is None:
        return None, None, RewardReady(ready=False, error="no init message (stdin closed)")
    try:
        fn = load_callable(init.fn)
        if hasattr(fn, "prepare"):  # a model-backed fn (reward.judge) loads it once, before the memory cap
            fn.prepare(**init.kwargs)
    except ValueError as e:
        return None, None, RewardReady(ready=False, error=str(e))
    except Exception as e:  # the model did not load: the pool reports the child failed to start, with why
        return None, None, RewardReady(ready=False, error=f"{init.fn} failed to prepare: {type(e).__name__}: {e}")
    if init.memory_limit_mb:  # after the imports: the cap is for the checks, not for loading the function
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (init.memory_limit_mb << 20, init.memory_limit_mb << 20))
    return fn, init.kwargs, RewardReady(ready=True, pid=os.getpid())


def _serve(fn, kwargs: dict, proto_in, proto_out) -> None:
    """Answer tasks until stdin closes, each reply flushed when its check ends; a malformed frame
    gets one error reply, not a crash."""
    replies = _ReplyFrames()
    while True:
        try:
            tasks = read_frame(proto_in, RewardTasks)
        except ProtocolError as e:
            proto_out.write(encode_frame(RewardReply(error=f"ProtocolError: {e}")))
            proto_out.flush()
            continue
        if tasks is None:
            return
        if hasattr(fn, "batch"):  # one call for the frame (a judge's batched generation), then its replies
            for reply in _run_batch(fn, kwargs, tasks.completions, tasks.solutions, tasks.prompts):
                proto_out.write(replies.frame(reply))
            proto_out.flush()
            continue
        for completion, solutions in zip(tasks.completions, tasks.solutions):
            proto_out.write(replies.frame(_run_one(fn, kwargs, completion, solutions)))
            proto_out.flush()  # before the next check starts: it may hang and be killed


class _ReplyFrames:
    """Encoded reply frames; a score's frame is encoded once (scores repeat: 0.0, 1.0, ...)."""

    MAX_CACHED = 1024

    def __init__(self):
        self.by_score: dict[bytes, bytes] = {}

    def frame(self, reply: RewardReply) -> bytes:
        if reply.error is not None:
            return encode_frame(reply)
        key = struct.pack(">d", reply.score)  # not the float itself: -0.0 == 0.0, nan != nan
        out = self.by_score.get(key)
        if out is None:
            out = encode_frame(reply)
            if len(self.by_score) < self.MAX_CACHED:
                self.by_score[key] = out
        return out


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent; it kills us
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), daemon=True).start()
    proto_in, proto_out = _protocol_streams()
    fn, kwargs, ready = _load(proto_in)
    try:
        proto_out.write(encode_frame(ready))
        proto_out.flush()
        if fn is not None:
            _serve(fn, kwargs, proto_in, proto_out)
    except BrokenPipeError:  # the parent died mid-check: nobody to answer, nothing to report
        os._exit(0)
    return 0 if fn is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
