"""The scheduler's end of the control plane: one ROUTER socket that every worker's DEALER connects to.

It drains what arrived (the frame that woke the loop and those queued behind it, up to ``DRAIN_MAX``,
then one pass of the caller's ``drive`` when one of them may have changed what it acts on), decodes each
frame once (a bad one is logged, rate-limited per peer, and answered with an ``Error``), and sends without a
Future a frame while nothing waits before it.
Both fast paths go through the synchronous shadow of the same socket (``zmq.Socket.shadow``); the asyncio
socket is used where a wait is needed: the next wake-up, and a send to a peer at its high-water mark (the
sends after it queue behind it, so one worker's frames keep their order). What the messages mean is
``service.py``'s.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional

import zmq
import zmq.asyncio
from protocols.messages import Error, Message
from protocols.rejections import RejectionLog
from protocols.sockets import decode_logged, make_socket, send_message

DRAIN_MAX = 256  # frames handled per wakeup before the core is driven (admit, plan) once


class Router:
    """The bound ROUTER socket, its synchronous shadow and the log of the frames it refused."""

    def __init__(self, endpoint: str, log: logging.Logger):
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=endpoint)
        self.queued = zmq.Socket.shadow(self.sock.underlying)  # the same socket, used without a Future per frame
        self._waiting_sends = 0  # sends awaiting the socket (a peer at its high-water mark): later ones queue behind
        self.rejections = RejectionLog(log)  # bad frames and refusals: rate-limited lines, a count per peer a minute

    async def serve(self, take: Callable[[list], Awaitable[bool]], drive: Callable[[], Awaitable]) -> None:
        """Per wakeup: the frame that woke us and those already queued behind it (up to
        ``DRAIN_MAX``, taken without waiting), each given to ``take`` in order; then one ``drive``, unless
        ``take`` said of every frame that it changed nothing ``drive`` acts on (a heartbeat, a ping)."""
        while True:
            frames, n, moved = await self.sock.recv_multipart(), 0, False
            while frames is not None:
                moved = await take(frames) or moved
                n += 1
                frames = self._queued_frames() if n < DRAIN_MAX else None
            if moved:
                await drive()

    def _queued_frames(self) -> Optional[list]:
        """A frame already queued, or None. Read through the synchronous shadow of the socket: the
        asyncio socket would do the same read wrapped in a Future (about 2 us a frame); the next
        ``await self.sock.recv_multipart()`` checks the socket's events first, so nothing is missed."""
        try:
            return self.queued.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def decode(self, frames: list) -> tuple[Optional[bytes], Optional[Message]]:
        """(sender identity, message) of a routed frame; a bad frame is logged and its sender told (None)."""
        ident, msg = decode_logged(frames, routed=True, where="scheduler", rejections=self.rejections)
        if msg is None:
            await self.reply_error(ident, "bad_frame", "frame rejected; see scheduler log")
        return ident, msg

    async def send_frames(self, frames: list) -> None:
        """Sent at once through the synchronous shadow when nothing waits before it (no Future a frame);
        at the peer's high-water mark (``zmq.Again``), and behind a send that waits, as an awaited send.
        ``zmq.ZMQError`` (ROUTER_MANDATORY: the peer is gone) is the caller's."""
        if not self._waiting_sends:
            try:
                return self.queued.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._waiting_sends += 1
        try:
            await self.sock.send_multipart(frames)
        finally:
            self._waiting_sends -= 1

    async def send_to(self, ident: bytes, msg: Message) -> Optional[zmq.ZMQError]:
        """``msg`` to a peer by its routing identity (registered or not); the error when it is gone."""
        try:
            await send_message(self.sock, msg, to=ident)
        except zmq.ZMQError as e:
            return e
        return None

    async def reply_error(self, ident: Optional[bytes], code: str, detail: str) -> None:
        """Tell the sender of a refused frame why (nothing to tell a sender that vanished)."""
        if ident is not None:
            await self.send_to(ident, Error(code=code, detail=detail))

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and end its context; frames already sent still leave for up to ``linger_s``
        (``ZMQ_LINGER``: ``term`` returns once they are out or the time is up, a peer gone drops its own)."""
        self.rejections.flush()
        self.sock.close(int(linger_s * 1000))
        self.ctx.term()
