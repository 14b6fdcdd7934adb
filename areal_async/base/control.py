"""A worker's link to the scheduler: one DEALER socket, registration, heartbeats.

The socket's routing identity is ``<worker id>/<random>``, new for every process: a peer cannot
take a live worker's identity over by guessing it (the scheduler maps it to the worker id after a
registration whose launch token matches the roster, see ``base/runkeys.py``).

Bad frames from the scheduler are logged and skipped (``protocols.sockets.recv_message``);
the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from typing import Callable, Optional

import zmq
import zmq.asyncio

from protocols.messages import Heartbeat, Message, Register, RegisterAck
from protocols.sockets import make_socket, recv_message, send_message

log = logging.getLogger("areal_async.control")


class ControlClient:
    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, role: str, worker_id: str, heartbeat_s: float, token: str = ""
    ):
        self.role, self.worker_id, self.heartbeat_s, self.token = role, worker_id, heartbeat_s, token
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=routing_identity(worker_id))
        self.stats: dict = {}
        self.live_stats: Optional[Callable[[], dict]] = None  # merged into every heartbeat's stats (ages now)
        self._hb: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()

    async def register(self, info: dict | None = None, timeout_s: float = 120.0) -> RegisterAck:
        await self.send(
            Register(
                role=self.role,
                worker_id=self.worker_id,
                pid=os.getpid(),
                host=socket.gethostname(),
                info=info or {},
                token=self.token,
            )
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await asyncio.wait_for(self.recv(), timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(msg, RegisterAck):
                self._hb = asyncio.create_task(self._heartbeat())
                return msg
            log.warning("%s: ignoring %s before registration was acknowledged", self.worker_id, type(msg).__name__)
        raise TimeoutError(f"{self.worker_id}: scheduler did not acknowledge registration within {timeout_s}s")

    @property
    def heartbeat_task(self) -> asyncio.Task:
        """The heartbeat loop (started by ``register``): services watch it with their own tasks."""
        if self._hb is None:
            raise RuntimeError(f"{self.worker_id}: no heartbeat before registration")
        return self._hb

    async def send(self, msg: Message) -> None:
        async with self._lock:  # one multipart send at a time per socket
            await send_message(self.sock, msg)

    async def recv(self) -> Message:
        while True:
            _, msg = await recv_message(self.sock, where=self.worker_id)
            if msg is not None:
                return msg

    async def _heartbeat(self) -> None:
        while True:
            live = self.live_stats() if self.live_stats is not None else {}
            await self.send(Heartbeat(worker_id=self.worker_id, ts=time.time(), stats={**self.stats, **live}))
            await asyncio.sleep(self.heartbeat_s)

    def close(self) -> None:
        if self._hb:
            self._hb.cancel()
        self.sock.close(0)


def routing_identity(worker_id: str) -> str:
    """``<worker id>/<random>``: unique per process (see the module docstring)."""
    return f"{worker_id}/{secrets.token_hex(8)}"


def worker_of(ident: bytes) -> str:
    """The worker id in a routing identity (``routing_identity``); a bare id is its own."""
    return ident.decode(errors="replace").split("/", 1)[0]
