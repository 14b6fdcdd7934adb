"""A peer process for two-sided measurements: this process drives, the peer holds the other end.

``Peer`` spawns a process that serves commands from an ops table over a pipe (msgpack bytes, never
pickle): ``ask`` sends one, ``answer`` waits for a reply (an op may reply more than once, e.g. an
ack per message), ``call`` does both, ``close`` asks it to exit and joins it. An op that raises is
reported back and raised here as RuntimeError naming the peer's error.

The ops are module-level functions ``op(state, cmd) -> reply``: ``state`` is the peer's dict
(``conn``, ``device`` and whatever ops keep there), ``cmd`` the command's fields; an op may send
extra replies with ``reply(state, msg)`` before returning its last one. ``benchmarks.common.channels``
has the ops for tensor and weight channels.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

import msgpack
import torch

Op = Callable[[dict, dict], dict]


def serve(conn, device: str, ops: dict[str, Op]) -> None:
    """The peer's loop: run ``ops[cmd["op"]](state, cmd)`` per command until ``exit``."""
    torch.set_num_threads(1)
    state: dict[str, Any] = {"conn": conn, "device": device}
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
        if cmd["op"] == "exit":
            reply(state, {"ok": True})
            return
        try:
            if cmd["op"] not in ops:
                raise KeyError(f"unknown peer op {cmd['op']!r}; known: {sorted(ops)}")
            out = ops[cmd["op"]](state, cmd)
        except Exception as e:  # reported to the parent, which raises it
            out = {"error": f"{type(e).__name__}: {e}"}
        reply(state, out)


def reply(state: dict, msg: dict) -> None:
    state["conn"].send_bytes(msgpack.packb(msg, use_bin_type=True))


class Peer:
    """A spawned process serving ``ops`` (module-level functions: they travel by name)."""

    def __init__(self, device: str, ops: dict[str, Op]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, device, ops), daemon=True)
        self.proc.start()

    def ask(self, op: str, **kw) -> None:
        self.conn.send_bytes(msgpack.packb({"op": op, **kw}, use_bin_type=True))

    def answer(self, timeout_s: float = 600) -> dict:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"benchmark peer (pid {self.proc.pid}) did not answer within {timeout_s}s")
        msg = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        if "error" in msg:
            raise RuntimeError(f"benchmark peer failed: {msg['error']}")
        return msg

    def call(self, op: str, **kw) -> dict:
        self.ask(op, **kw)
        return self.answer()

    def close(self, timeout_s: float = 10) -> None:
        """Ask the peer to exit; kill it (our own child, by pid) if it has not within timeout_s
        (e.g. still inside an op after this side raised)."""
        if self.proc.is_alive():
            try:
                self.ask("exit")
            except OSError:  # the pipe is gone: the peer died
                pass
            self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
