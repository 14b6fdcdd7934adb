"""The scheduler's ROUTER loop behind a real socket: per wakeup, ``drive`` runs once after the frames taken, and
not at all when ``take`` said of every one of them that it moved nothing (a heartbeat, a ping)."""

import asyncio
import logging

import zmq
import zmq.asyncio

from areal_async.scheduler.router import Router
from protocols.sockets import ipc_endpoint, make_socket


async def _until(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_drive_runs_only_after_a_frame_that_moved_something(tmp_path):
    router = Router(ipc_endpoint(tmp_path, "c"), logging.getLogger("test.router"))
    taken, drives = [], []

    async def take(frames: list) -> bool:
        taken.append(bytes(frames[1]))
        return frames[1] == b"moves"

    async def drive() -> None:
        drives.append(len(taken))

    serve = asyncio.create_task(router.serve(take, drive))
    ctx = zmq.asyncio.Context()
    peer = make_socket(ctx, zmq.DEALER, connect=ipc_endpoint(tmp_path, "c"), identity="rollout-0")
    try:
        for _ in range(5):
            await peer.send(b"still")
        await _until(lambda: len(taken) == 5)
        await asyncio.sleep(0.05)
        assert drives == []  # five frames that moved nothing: no drive, however many wakeups they took
        await peer.send(b"moves")
        await _until(lambda: drives)
        await peer.send(b"still")
        await _until(lambda: len(taken) == 7)
        await asyncio.sleep(0.05)
        assert taken == [b"still"] * 5 + [b"moves", b"still"] and drives == [6]
    finally:
        serve.cancel()
        peer.close(0)
        ctx.term()
        router.close()
