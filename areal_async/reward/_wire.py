"""Framing shared by the reward pool and its children: 4-byte big-endian length + msgpack body.

The bodies are the typed ``protocols.side`` reward messages (``RewardInit``, ``RewardReady``,
``RewardTasks``, ``RewardReply``), encoded and decoded by ``protocols.messages``: msgpack (never
pickle) so that a child can only ever send data, not code, to the parent.
"""

from __future__ import annotations

import struct

from protocols.messages import SideMessage, decode, encode

HEADER = struct.Struct(">I")


def read_frame(stream, expect: type[SideMessage]) -> SideMessage | None:
    """Next message from a binary stream, or None at EOF; ``ProtocolError`` if the body is not an ``expect``."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    body = stream.read(n)
    if len(body) < n:
        return None
    return decode(body, (expect,))


def encode_frame(msg: SideMessage) -> bytes:
    body = encode(msg)
    return HEADER.pack(len(body)) + body
