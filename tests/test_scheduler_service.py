"""The real scheduler process logic behind a real ROUTER socket: bad input is refused with a
clear error, nothing in the books changes, and the scheduler keeps serving."""

import asyncio
import logging
import os

import msgpack
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import decode
from protocols.sockets import ipc_endpoint, make_socket, send_message

from areal_async.config import from_dict
from areal_async.base.endpoints import Endpoints
from areal_async.scheduler.service import SchedulerService


async def recv(sock, timeout=5.0):
    return decode(await asyncio.wait_for(sock.recv(), timeout))


async def test_scheduler_refuses_bad_frames_and_keeps_serving(tmp_path, caplog):
    cfg = from_dict({}, ["train_dataset.batch_size=2", "gconfig.n_samples=2"])
    ep = Endpoints(ipc_endpoint(tmp_path, "c"), ipc_endpoint(tmp_path, "t"), [], str(tmp_path))
    svc = SchedulerService(cfg, ep, tmp_path / "run", t0=0.0, tokenize=lambda s: [1] + [ord(c) for c in s])
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    w = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="rollout-0")
    stranger = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="nobody")
    try:
        await send_message(w, M.Register(role="rollout", worker_id="rollout-0", pid=os.getpid()))
        assert isinstance(await recv(w), M.RegisterAck)
        await send_message(w, M.TrainerReady(version=0, next_step=0))  # only the trainer may say this
        err = await recv(w)
        assert isinstance(err, M.Error) and err.code == "refused"
        assert "rollout worker may not send 'trainer_ready'" in err.detail
        assert not svc.core.trainer_ready
        with caplog.at_level(logging.ERROR):
            for frame in (
                os.urandom(40),
                msgpack.packb({"v": 99, "t": "ping", "b": {"nonce": 1}}),
                msgpack.packb({"v": M.PROTOCOL_VERSION, "t": "reward_result", "b": {"sample_ids": 3}}),
            ):
                await w.send(frame)
            errors = []
            while len(errors) < 3:
                msg = await recv(w)
                if isinstance(msg, M.Error):
                    errors.append(msg)
        assert all(e.code == "bad_frame" for e in errors)
        assert sum("rejected a frame" in r.getMessage() for r in caplog.records) == 3
        # a peer that never registered is refused by name
        await send_message(stranger, M.Heartbeat(worker_id="nobody", ts=0.0))
        err = await recv(stranger)
        assert isinstance(err, M.Error) and "unregistered peer 'nobody'" in err.detail
        # a result for a sample nobody issued changes nothing
        await send_message(
            w,
            M.TrajectoryReady(
                group_id="g99",
                worker_id="rollout-0",
                n_prompt_tokens=1,
                sample_ids=["g99.0"],
                n_output_tokens=[1],
                version_min=[0],
                version_max=[0],
                finish_reasons=["stop"],
            ),
        )
        await send_message(w, M.Ping(nonce=7))
        assert await recv(w) == M.Pong(nonce=7)
        assert svc.core.ledger.n_trained == 0 and "g99.0" not in svc.core.ledger.samples
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)
