"""Framing of the private pipes: 4-byte big-endian length + msgpack body.

The reward pool and its children, and the supervisor and its fork server (``supervisor/zygote.py``),
talk over it. The bodies are typed ``protocols.side`` messages (``RewardInit``, ``RewardReady``,
``RewardTasks``, ``RewardReply``; ``ForkRequest`` ...), encoded and decoded by ``protocols.messages``:
msgpack (never pickle) so that a child can only ever send data, not code, to the parent.
"""

from __future__ import annotations

import struct

from protocols.messages import SideMessage, decode, encode

HEADER = struct.Struct(">I")


def read_frame(stream, expect: type[SideMessage] | tuple[type[SideMessage], ...]) -> SideMessage | None:
    """Next message from a binary stream, or None at EOF; ``ProtocolError`` if the body is not an ``expect``
    (a class, or a tuple of classes)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    body = stream.read(n)
    if len(body) < n:
        return None
    return decode(body, expect if isinstance(expect, tuple) else (expect,))


def encode_frame(msg: SideMessage) -> bytes:
    body = encode(msg)
    return HEADER.pack(len(body)) + body
