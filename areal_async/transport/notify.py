"""The small ZeroMQ PUSH/PULL pipe every channel uses for its in-band part.

The receiver (trainer) binds a PULL socket; each sender (rollout worker) connects a PUSH. For the
zmq channel the whole message travels here; for shm/gloo/nccl/cuda_ipc only a note (a
``protocols.side`` message: tensor header + where the payload is) does, and the bytes move out of
band. PUSH blocks at the high-water mark instead of dropping (see ``protocols.sockets``), so a note
is never lost. The receiver's PULL refuses frames over ``max_bytes`` (``ZMQ_MAXMSGSIZE``): a note
is small (the control bound); the zmq channel, whose tensors travel here, passes its frame bound.

pyzmq is imported when a pipe is made, not with this module: the channels that import it (gloo, nccl,
cuda_ipc) then import without pyzmq, as the GPU checks of ``scripts/gpu_check.sh`` need on a bare box.
"""

from __future__ import annotations

import time
from typing import Optional

from protocols.messages import MAX_MESSAGE_BYTES, SideMessage, decode, encode

SEND_LINGER_MS = 5000  # a closing sender still flushes what it queued; LINGER 0 would drop it


class Pipe:
    """One end of the PUSH/PULL pipe; ``role`` is 'sender' or 'receiver'."""

    def __init__(self, role: str, endpoint: str, max_bytes: int = MAX_MESSAGE_BYTES):
        if role not in ("sender", "receiver"):
            raise ValueError(f"role={role!r}: expected 'sender' or 'receiver'")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint={endpoint!r}: expected a ZeroMQ address such as 'tcp://127.0.0.1:5555'")
        import zmq

        from protocols.sockets import make_socket

        self.role, self._pollin = role, zmq.POLLIN
        self.ctx = zmq.Context.instance()
        if role == "sender":
            self.sock = make_socket(self.ctx, zmq.PUSH, connect=endpoint)
            self.sock.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        else:
            self.sock = make_socket(self.ctx, zmq.PULL, bind=endpoint, max_bytes=max_bytes)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if role == "receiver" else endpoint

    def wait(self, deadline: Optional[float]) -> None:
        """Block until a message is readable; ``TimeoutError`` at ``deadline`` (monotonic s)."""
        timeout_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if not self.sock.poll(timeout_ms, self._pollin):
            raise TimeoutError(f"no tensor message on {self.endpoint} in time")

    def send_note(self, note: SideMessage) -> None:
        self.sock.send(encode(note))

    def recv_note(self, expect: tuple[type[SideMessage], ...]) -> SideMessage:
        """The next note, decoded as one of ``expect`` (``protocols.side``); ``ProtocolError`` if not."""
        return decode(self.sock.recv(copy=False).buffer, expect)

    def close(self) -> None:
        self.sock.close()


def deadline_of(timeout_s: Optional[float]) -> Optional[float]:
    return None if timeout_s is None else time.monotonic() + timeout_s
