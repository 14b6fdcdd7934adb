"""The scheduler's ROUTER at the end of a run (scheduler/router.py ``close``): the frames it sent just before
closing still reach a live peer when it closes with a linger, and the close returns as soon as they are out."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from areal_async.scheduler.router import Router
from protocols.sockets import ipc_endpoint, make_socket

N_FRAMES, FRAME_BYTES = 64, 256 << 10  # 16 MiB queued: more than a socket pair buffers, so a close drops them


async def _sent_then_closed(tmp_path, linger_s: float) -> tuple[int, float]:
    """(frames the peer received, seconds the router's close took) after N_FRAMES sent and an immediate close."""
    endpoint = ipc_endpoint(tmp_path, "control")
    router = Router(endpoint, logging.getLogger("test"))
    ctx = zmq.Context()
    peer = make_socket(ctx, zmq.DEALER, connect=endpoint, identity="rollout-0", max_bytes=2 * FRAME_BYTES)
    try:
        peer.send(b"hello")
        ident, _ = await asyncio.wait_for(router.sock.recv_multipart(), 5)
        for i in range(N_FRAMES):
            await router.sock.send_multipart([ident, bytes([i % 256]) * FRAME_BYTES])
        t = time.perf_counter()
        router.close(linger_s)
        took = time.perf_counter() - t
        got = 0
        while peer.poll(500):
            frame = peer.recv()
            assert frame == bytes([got % 256]) * FRAME_BYTES  # in order, whole
            got += 1
        return got, took
    finally:
        peer.close(0)
        ctx.term()


async def test_frames_sent_before_a_lingering_close_all_arrive(tmp_path):
    got, took = await _sent_then_closed(tmp_path, linger_s=5.0)
    assert got == N_FRAMES
    assert took < 4.0  # it returned once they were out, not at the end of the linger


async def test_a_close_without_linger_drops_what_is_still_queued(tmp_path):
    """Why the run's end lingers: the frames still queued when the socket closes are lost without it."""
    got, _ = await _sent_then_closed(tmp_path, linger_s=0.0)
    assert got < N_FRAMES
