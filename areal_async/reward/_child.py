"""Entry point of one reward child process (``python -m areal_async.reward._child PARENT_PID``).

Protocol, msgpack frames (see ``_wire.py``) over the child's stdin/stdout, never
pickle, one task at a time:

    parent -> child  {"fn": "mod:func", "kwargs": {...}, "memory_limit_mb": N}   once, first
    child  -> parent {"ready": true, "pid": ...} | {"ready": false, "error": "..."}
    parent -> child  {"completion": "...", "solutions": ["..."]}  repeated
    child  -> parent {"score": 1.0} | {"error": "..."}

The reward function runs in this process's MAIN thread. The child exits when its stdin closes
(the parent closed the pool or died); a watchdog thread also exits it when it is re-parented
(parent killed) so a long check cannot outlive the pool. The parent enforces timeouts by
SIGKILL, so nothing here tries to be interruptible.
Imports are kept minimal on purpose: no torch, no zmq — only what the reward function imports.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import threading
import time

from areal_async.reward._wire import encode_frame, read_frame

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


def _run_one(fn, kwargs: dict, msg: dict) -> dict:
    try:
        value = fn(msg["completion"], msg["solutions"], **kwargs)
    except Exception as e:  # the reward fn's bug becomes an "error" outcome; this child lives on
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        kind = type(value).__name__
        return {"error": f"reward function returned {value!r:.200} ({kind}); expected a finite real number"}
    return {"score": float(value)}


def _load(init: dict | None):
    """(fn, kwargs, ready message) from the init message."""
    from areal_async.utils.plugins import load_callable

    if not init or "fn" not in init:
        return None, None, {"ready": False, "error": f"bad init message {init!r:.200}"}
    try:
        fn = load_callable(init["fn"])
    except ValueError as e:
        return None, None, {"ready": False, "error": str(e)}
    limit_mb = init.get("memory_limit_mb") or 0
    if limit_mb:  # after the imports: the cap is for the checks, not for loading the function
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    return fn, init.get("kwargs") or {}, {"ready": True, "pid": os.getpid()}


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent; it kills us
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), daemon=True).start()
    proto_in, proto_out = _protocol_streams()
    fn, kwargs, ready = _load(read_frame(proto_in))
    try:
        proto_out.write(encode_frame(ready))
        proto_out.flush()
        while fn is not None and (msg := read_frame(proto_in)) is not None:
            proto_out.write(encode_frame(_run_one(fn, kwargs, msg)))
            proto_out.flush()
    except BrokenPipeError:  # the parent died mid-check: nobody to answer, nothing to report
        os._exit(0)
    return 0 if fn is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
