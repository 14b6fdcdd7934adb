"""The reward worker behind real sockets: a group's completions in one RewardRequest come back in
a Batch of RewardResult with a score per sample (real math-verify in the real killable pool); groups
queued together come back together, each with its own scores; a malformed frame on its work queue
is logged and dropped while it keeps serving."""

import asyncio
import json
import logging

import msgpack
import pytest
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import decode
from protocols.sockets import ipc_endpoint, make_socket, send_message

from areal_async.reward.pool import RewardPool
from areal_async.reward.service import RewardService
from areal_async.rollout.service import reward_batches
from areal_async.base.control import ControlClient
from areal_async.base.records import RewardRecord


async def next_of(sock, cls, timeout=30.0):
    """The next message of type ``cls`` from the ROUTER (heartbeats skipped): (ident, msg)."""

    async def loop():
        while True:
            ident, frame = await sock.recv_multipart()
            msg = decode(frame)
            if isinstance(msg, cls):
                return ident, msg

    return await asyncio.wait_for(loop(), timeout)


async def test_reward_worker_scores_a_group_in_one_result_and_survives_bad_frames(tmp_path, caplog):
    ctx = zmq.asyncio.Context()
    control_ep, work_ep = ipc_endpoint(tmp_path, "control"), ipc_endpoint(tmp_path, "work")
    scheduler = make_socket(ctx, zmq.ROUTER, bind=control_ep)
    pool = RewardPool(n_procs=2, timeout_s=20.0)
    control = ControlClient(ctx, control_ep, "reward", "reward-0", heartbeat_s=0.2)
    record = RewardRecord(tmp_path, "reward-0")
    svc = RewardService("reward-0", control, ctx, work_ep, pool, n_procs=2, record=record)
    task = asyncio.create_task(svc.run())
    push = make_socket(ctx, zmq.PUSH, connect=work_ep)
    ident = None  # routing identities are '<id>/<random>': reply to the one that registered
    try:
        ident, reg = await next_of(scheduler, M.Register)
        assert reg.role == "reward" and reg.info == {"n_procs": 2}
        await send_message(scheduler, M.RegisterAck(worker_id="reward-0", version=0), to=ident)

        with caplog.at_level(logging.ERROR):
            await push.send(
                msgpack.packb(
                    {
                        "v": M.PROTOCOL_VERSION,
                        "t": "reward_request",
                        "b": {"group_id": "g0", "sample_ids": ["g0.0"], "completions": [], "solutions": ["7"]},
                    }
                )
            )
            await push.send(b"\x00garbage")
            completions = ["so \\boxed{7}", "\\boxed{07}", "\\boxed{8}", "no box at all"]
            await send_message(
                push,
                M.RewardRequest(
                    group_id="g1", sample_ids=[f"g1.{k}" for k in range(4)], completions=completions, solutions=["7"]
                ),
            )
            _, batch = await next_of(scheduler, M.Batch)
        (res,) = batch.items()
        assert res.group_id == "g1" and res.worker_id == "reward-0"
        assert res.sample_ids == ["g1.0", "g1.1", "g1.2", "g1.3"]
        assert res.scores == [1.0, 1.0, 0.0, 0.0] and res.statuses == ["ok"] * 4
        # the worker's own record of it was on disk when the result arrived (written before it left)
        assert [json.loads(x) for x in (tmp_path / "reward_records" / "reward-0.jsonl").read_text().splitlines()] == [
            {
                "group_id": "g1",
                "ids": ["g1.0", "g1.1", "g1.2", "g1.3"],
                "scores": [1.0, 1.0, 0.0, 0.0],
                "statuses": ["ok"] * 4,
            }
        ]
        assert sum("rejected a frame" in r.getMessage() for r in caplog.records) == 2
        assert "parallel lists differ in length" in caplog.text
        assert svc.counts["ok"] == 4

        # groups queued together are scored in one pool call; each still gets its own scores
        answers = {f"g{k}": [f"\\boxed{{{k}}}", "\\boxed{0}", f"{k}"] for k in range(2, 7)}
        for gid, comps in answers.items():
            sids = [f"{gid}.{j}" for j in range(len(comps))]
            await send_message(
                push, M.RewardRequest(group_id=gid, sample_ids=sids, completions=comps, solutions=[gid[1]])
            )
        got = {}
        while len(got) < len(answers):
            _, batch = await next_of(scheduler, M.Batch)
            for res in batch.items():
                assert res.group_id not in got, f"group {res.group_id} scored twice"
                got[res.group_id] = res
        assert set(got) == set(answers)
        for gid in answers:
            assert got[gid].sample_ids == [f"{gid}.{j}" for j in range(3)]
            assert got[gid].scores == [1.0, 0.0, 0.0] and got[gid].statuses == ["ok"] * 3
        assert svc.counts["ok"] == 4 + 15 and svc.scoring == 0

        # several groups in one Batch (a rollout worker's engine step): each scored as its own
        many = M.Batch.of(
            [
                M.RewardRequest(
                    group_id="g7", sample_ids=["g7.0", "g7.1"], completions=["\\boxed{3}", "x"], solutions=["3"]
                ),
                M.RewardRequest(group_id="g8", sample_ids=["g8.0"], completions=["\\boxed{4}"], solutions=["4"]),
                M.RewardRequest(group_id="g9", sample_ids=["g9.0"], completions=["\\boxed{5}"], solutions=["6"]),
            ]
        )
        await send_message(push, many)
        got = {}
        while len(got) < 3:
            _, batch = await next_of(scheduler, M.Batch)
            for res in batch.items():
                assert res.group_id not in got, f"group {res.group_id} scored twice"
                got[res.group_id] = res
        assert {g: (r.sample_ids, r.scores) for g, r in got.items()} == {
            "g7": (["g7.0", "g7.1"], [1.0, 0.0]),
            "g8": (["g8.0"], [1.0]),
            "g9": (["g9.0"], [0.0]),
        }
        assert svc.counts["ok"] == 4 + 15 + 4 and svc.scoring == 0
    finally:
        if ident is not None:
            await send_message(scheduler, M.Shutdown(reason="test"), to=ident)
        assert await asyncio.wait_for(task, 10) == 0
        assert pool.pids() == []  # the service closed its pool: no checking process left
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "n_groups, n_peers, sizes",
    [(32, 1, [32]), (32, 3, [10, 11, 11]), (2, 3, [1, 1]), (1, 1, [1]), (5, 2, [2, 3])],
)
def test_reward_batches_one_message_a_reward_worker_groups_in_order(n_groups, n_peers, sizes):
    reqs = [M.RewardRequest(f"g{i}", [f"g{i}.0"], ["c"], ["s"]) for i in range(n_groups)]
    batches = reward_batches(reqs, n_peers)
    assert [b.size for b in batches] == sizes and all(b.kind == "reward_request" for b in batches)
    assert [r for b in batches for r in b.items()] == reqs
