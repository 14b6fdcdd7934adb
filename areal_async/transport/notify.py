"""The small ZeroMQ PUSH/PULL pipe every channel uses for its in-band part.

The receiver (trainer) binds a PULL socket; each sender (rollout worker) connects a PUSH. For the
zmq channel the whole message travels here; for shm/gloo/nccl/cuda_ipc only a msgpack note
(tensor header + where the payload is) does, and the bytes move out of band. PUSH blocks at the
high-water mark instead of dropping (see ``protocols.sockets``), so a note is never lost.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import msgpack
import zmq

from protocols.messages import PROTOCOL_VERSION, ProtocolError
from protocols.sockets import make_socket

SEND_LINGER_MS = 5000  # a closing sender still flushes what it queued; LINGER 0 would drop it
MAX_NOTE_BYTES = 8 * 1024 * 1024


class Pipe:
    """One end of the PUSH/PULL pipe; ``role`` is 'sender' or 'receiver'."""

    def __init__(self, role: str, endpoint: str):
        if role not in ("sender", "receiver"):
            raise ValueError(f"role={role!r}: expected 'sender' or 'receiver'")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint={endpoint!r}: expected a ZeroMQ address such as 'tcp://127.0.0.1:5555'")
        self.role = role
        self.ctx = zmq.Context.instance()
        if role == "sender":
            self.sock = make_socket(self.ctx, zmq.PUSH, connect=endpoint)
            self.sock.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        else:
            self.sock = make_socket(self.ctx, zmq.PULL, bind=endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if role == "receiver" else endpoint

    def wait(self, deadline: Optional[float]) -> None:
        """Block until a message is readable; ``TimeoutError`` at ``deadline`` (monotonic s)."""
        timeout_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"no tensor message on {self.endpoint} in time")

    def close(self) -> None:
        self.sock.close()


def deadline_of(timeout_s: Optional[float]) -> Optional[float]:
    return None if timeout_s is None else time.monotonic() + timeout_s


def pack_note(kind: str, body: dict) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **body}, use_bin_type=True)


def unpack_note(raw: Any, schema: dict[str, dict[str, type | tuple]]) -> dict:
    """Decode a note and check its type and fields against ``schema[type]``; ``ProtocolError`` if off."""
    buf = raw.buffer if hasattr(raw, "buffer") else memoryview(raw)
    if len(buf) > MAX_NOTE_BYTES:
        raise ProtocolError(f"tensor note of {len(buf)} bytes exceeds {MAX_NOTE_BYTES}")
    try:
        note = msgpack.unpackb(buf, raw=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"tensor note is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(note, dict) or note.get("v") != PROTOCOL_VERSION or note.get("t") not in schema:
        head = {k: note.get(k) for k in ("v", "t")} if isinstance(note, dict) else type(note).__name__
        raise ProtocolError(f"tensor note {head}: expected v={PROTOCOL_VERSION} and t in {sorted(schema)}")
    fields = schema[note["t"]]
    if set(note) - {"v", "t"} != set(fields):
        raise ProtocolError(f"tensor note {note['t']!r} has fields {sorted(set(note) - {'v', 't'})}, expected {sorted(fields)}")
    for name, typ in fields.items():
        if not isinstance(note[name], typ):
            raise ProtocolError(f"tensor note {note['t']!r}: field {name!r} is {type(note[name]).__name__}, expected {typ}")
    return note


def int_list(xs: Any, what: str) -> list[int]:
    if not isinstance(xs, list) or not all(isinstance(x, int) and x >= 0 for x in xs):
        raise ProtocolError(f"{what} {xs!r}: expected a list of ints >= 0")
    return xs
