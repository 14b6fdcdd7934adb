"""Socket patterns of the control plane, on pyzmq's asyncio API.

- control: the scheduler binds one ROUTER; every worker connects a DEALER and registers.
  ROUTER/DEALER gives addressed, asynchronous, bidirectional traffic over one socket pair.
- work queues: PUSH/PULL (rollout -> reward requests; rollout -> trainer trajectory tensors).

Why the high-water marks cannot drop our messages: ZeroMQ drops on HWM only for PUB and for
ROUTER sends to a peer it cannot route (ROUTER_MANDATORY makes that an error instead). DEALER
and PUSH *block* at the HWM (back-pressure); they never discard. So with ROUTER_MANDATORY on the
scheduler, every send either arrives or raises.

A restarted worker reconnects with its old identity; ROUTER_HANDOVER lets the new connection
take the identity over at once (without it the ROUTER would ignore the newcomer until it noticed
the old connection was gone).

Size limits at the socket: every socket gets ``ZMQ_MAXMSGSIZE`` (control messages:
``MAX_MESSAGE_BYTES``; tensor sockets pass their own bound), so a peer that sends a bigger frame
is disconnected by libzmq before the frame is allocated, and the receiver keeps serving.

Authentication: with the run's CURVE keys set (``protocols.curve.use_curve``), every ``tcp://``
socket is a CURVE server (bind) or client (connect), and servers admit only the run's client keys.

Nodes: a process given its node's address (``use_source_host``, from ``cluster.node_hosts``)
connects every ``tcp://`` socket from that address, as it binds on it.

Receivers never die on a bad frame: ``recv_message`` turns any undecodable frame into a logged
``ProtocolError`` and returns None, and the caller goes on serving. The log is rate-limited with a
periodic count per receiver, peer and reason (``protocols.rejections``), so a flood cannot fill the disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import zmq
import zmq.asyncio

from protocols.curve import CURVE_FRAME_OVERHEAD, secure
from protocols.ports import free_tcp_port  # noqa: F401 (re-exported: its home without pyzmq)
from protocols.messages import MAX_MESSAGE_BYTES, Message, ProtocolError, decode, encode
from protocols.rejections import RejectionLog

log = logging.getLogger("areal_async.protocols")
REJECTIONS = RejectionLog(log, max_lines=100)  # the bad frames of this process's receivers without a log of their own

HWM = 100_000

_SOURCE_HOST: Optional[str] = None  # the address this process's tcp:// connections leave from (None: the kernel's)


def use_source_host(host: Optional[str]) -> None:
    """Connect every later ``tcp://`` socket of this process from ``host`` (its node's address; None:
    let the kernel choose). A fleet's node k binds and connects on its own address."""
    global _SOURCE_HOST
    _SOURCE_HOST = host or None


def source_host() -> Optional[str]:
    """This process's node address, as ``use_source_host`` set it (None: not placed on a named node)."""
    return _SOURCE_HOST


def connect_address(endpoint: str) -> str:
    """``endpoint`` as ZeroMQ connects to it: ``tcp://SOURCE:0;HOST:PORT`` when this process has a
    source address (``use_source_host``), else unchanged."""
    if _SOURCE_HOST is None or not endpoint.startswith("tcp://"):
        return endpoint
    return f"tcp://{_SOURCE_HOST}:0;{endpoint[len('tcp://') :]}"


def ipc_endpoint(sock_dir: str | Path, name: str) -> str:
    path = Path(sock_dir) / f"{name}.sock"
    if len(str(path)) > 100:  # sun_path is 108 bytes on Linux
        raise ValueError(
            f"ipc socket path {str(path)!r} is too long ({len(str(path))} > 100 chars); use a shorter directory"
        )
    return f"ipc://{path}"


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | list[str] | None = None,
    identity: str | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> zmq.Socket:
    """A socket with the project's options: no linger, high-water marks, ``ZMQ_MAXMSGSIZE = max_bytes``
    (a larger inbound frame drops the sender's connection), ROUTER options, and CURVE on ``tcp://``."""
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r}: expected a positive int (bytes per inbound frame)")
    connects = [connect] if isinstance(connect, str) else list(connect or [])
    if bind and connects:
        raise ValueError(f"a socket either binds or connects; got bind={bind!r} and connect={connects!r}")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    try:
        secured = [secure(sock, ctx, bind, server=True)] if bind else []
        secured += [secure(sock, ctx, ep, server=False) for ep in connects]
        if any(secured):
            sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + CURVE_FRAME_OVERHEAD)  # the bound is on the wire frame
        if bind:
            sock.bind(bind)
        for ep in connects:
            sock.connect(connect_address(ep))
    except BaseException:
        sock.close(0)  # an open socket would hold its context's term() for ever
        raise
    return sock


async def send_message(sock: zmq.asyncio.Socket, msg: Message, to: Optional[bytes] = None) -> None:
    data = encode(msg)
    await (sock.send_multipart([to, data]) if to is not None else sock.send(data))


def decode_frames(frames: list, routed: bool, expect: Optional[tuple] = None) -> tuple[Optional[bytes], Message]:
    """frames of one recv_multipart -> (sender identity or None, message); ProtocolError if bad."""
    if routed:
        if len(frames) != 2:
            raise ProtocolError(f"expected [identity, message] frames, got {len(frames)} frames")
        return bytes(frames[0]), decode(frames[1], expect)
    if len(frames) != 1:
        raise ProtocolError(f"expected one message frame, got {len(frames)} frames")
    return None, decode(frames[0], expect)


async def recv_message(
    sock: zmq.asyncio.Socket, routed: bool = False, expect: Optional[tuple] = None, where: str = ""
) -> tuple[Optional[bytes], Optional[Message]]:
    """Receive one message; a bad frame is logged and returned as (sender, None)."""
    return decode_logged(await sock.recv_multipart(), routed, expect, where)


def decode_logged(
    frames: list,
    routed: bool = False,
    expect: Optional[tuple] = None,
    where: str = "",
    rejections: Optional[RejectionLog] = None,
) -> tuple[Optional[bytes], Optional[Message]]:
    """``decode_frames``, with a bad frame logged (rate-limited: ``rejections``, else this process's
    ``REJECTIONS``) and returned as (sender, None)."""
    try:
        return decode_frames(frames, routed, expect)
    except ProtocolError as e:
        sender = bytes(frames[0]) if routed and frames else None
        where = where or "receiver"
        text = "%s: rejected a frame from %r: %s"
        (rejections or REJECTIONS).reject(where, sender, "bad frame", text, where, sender, e)
        return sender, None


def run_async(coro) -> object:
    """Run a coroutine on uvloop where installed (Linux/macOS), plain asyncio otherwise."""
    import asyncio

    if not os.environ.get("AREAL_NO_UVLOOP"):
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)
