"""Framing shared by the reward pool and its children: 4-byte big-endian length + msgpack body.

msgpack (never pickle) so that a child can only ever send data, not code, to the parent.
"""

from __future__ import annotations

import struct

import msgpack

HEADER = struct.Struct(">I")


def read_frame(stream) -> dict | None:
    """Next message from a binary stream, or None at EOF."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    body = stream.read(n)
    if len(body) < n:
        return None
    return msgpack.unpackb(body, raw=False)


def encode_frame(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body
