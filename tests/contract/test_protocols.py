"""Wire protocol: typed msgpack messages, tensor frames, and receivers that survive bad frames."""

import asyncio
import logging
import os

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import PROTOCOL_VERSION, REGISTRY, ProtocolError, decode, encode
from protocols.side import ShmRetire
from protocols.sockets import make_socket, recv_message, send_message
from protocols.tensors import decode_tensors, encode_tensors

SAMPLES = {
    "register": M.Register(role="rollout", worker_id="r0", pid=12, host="h", info={"a": 1}),
    "register_ack": M.RegisterAck(worker_id="r0", version=3),
    "heartbeat": M.Heartbeat(worker_id="r0", ts=1.5, stats={"x": 2}),
    "generate_request": M.GenerateRequest(
        group_id="g1",
        prompt_id="e0p1",
        sample_ids=["g1.0", "g1.1"],
        prompt_ids=[1, 5, 6],
        solutions=["7"],
        min_version=2,
        max_new_tokens=8,
        temperature=0.7,
        top_p=0.9,
        greedy=False,
        stop_token_ids=[2],
    ),
    "trajectory_ready": M.TrajectoryReady(
        group_id="g1",
        worker_id="r0",
        n_prompt_tokens=3,
        sample_ids=["g1.0", "g1.1"],
        n_output_tokens=[4, 0],
        version_min=[1, -1],
        version_max=[2, -1],
        finish_reasons=["stop", "length"],
    ),
    "batch": M.Batch.of(
        [
            M.RewardResult("g1", "w", ["g1.0", "g1.1"], [1.0, 0.0], ["ok", "timeout"], ["", "killed after 5.0 s"]),
            M.RewardResult("g2", "w", ["g2.0"], [0.5], ["ok"], [""]),
        ]
    ),
    "reward_request": M.RewardRequest(
        group_id="g1", sample_ids=["g1.0", "g1.1"], completions=["\\boxed{7}", ""], solutions=["7"]
    ),
    "reward_result": M.RewardResult(
        group_id="g1",
        worker_id="w",
        sample_ids=["g1.0", "g1.1"],
        scores=[1.0, 0.0],
        statuses=["ok", "timeout"],
        details=["", "killed after 5.0 s"],
    ),
    "batch_plan": M.BatchPlan(step=0, sample_ids=["a"], group_ids=["g"], scores=[0.5], aborted_ids=["b"], revision=1),
    "held_query": M.HeldQuery(query_id=3, worker_id="rollout-1", sample_ids=["a", "b"]),
    "held_reply": M.HeldReply(query_id=3, missing_ids=["b"]),
    "train_step_done": M.TrainStepDone(step=0, version=1, metrics={"loss": 0.1}, checkpoint=""),
    "status_request": M.StatusRequest(nonce=5),
    "status_report": M.StatusReport(
        nonce=5,
        version=3,
        next_step=3,
        total_steps=9,
        finished=False,
        wall_s=1.5,
        admitted=10,
        running=2,
        ready=1,
        stale=4,
        samples_trained=48,
        samples_aborted=4,
        workers=[
            {
                "worker_id": "rollout-0",
                "role": "rollout",
                "pid": 7,
                "host": "h",
                "state": "alive",
                "version": 3,
                "samples": 60,
                "samples_per_s": 2.5,
                "groups": 3,
                "restarts": 0,
                "silent_s": 0.2,
            }
        ],
    ),
    "eval_done": M.EvalDone(version=4, metrics={"eval_pass1": 0.375, "eval_pass1_ci_low": None, "eval_k": 8}),
    "weights_published": M.WeightsPublished(version=1, manifest={"kind": "shm", "names": ["w"]}),
    "weights_loaded": M.WeightsLoaded(worker_id="r0", version=1),
    "trainer_ready": M.TrainerReady(version=0, next_step=0),
    "checkpoint_request": M.CheckpointRequest(step=3, state={"cursor": {"epoch": 0}}),
    "checkpoint_saved": M.CheckpointSaved(step=3, path="/run/checkpoints/step_3"),
    "shutdown": M.Shutdown(reason="lost: no heartbeat for 9s", lost=True),
    "error": M.Error(code="bad", detail="why", worker_id="x"),
    "group_aborted": M.GroupAborted(group_id="g1", worker_id="rollout-0", reason="workflow m:W, sample g1.0: boom"),
    "abort_groups": M.AbortGroups(group_ids=["g1", "g2"], reason="deadline"),
    "groups_stopped": M.GroupsStopped(worker_id="rollout-0", group_ids=["g1", "g2"], n_output_tokens=[7, 0]),
    "ping": M.Ping(nonce=1),
    "pong": M.Pong(nonce=1),
}


def test_every_registered_message_round_trips():
    assert set(SAMPLES) == set(REGISTRY)
    for name, msg in SAMPLES.items():
        assert decode(encode(msg)) == msg, name


def _group_body(**over):
    body = {
        "group_id": "g1",
        "worker_id": "w",
        "sample_ids": ["g1.0", "g1.1"],
        "scores": [1.0, 0.0],
        "statuses": ["ok", "ok"],
        "details": ["", ""],
    }
    return {**body, **over}


def envelope(t="ping", b=None, v=PROTOCOL_VERSION):
    return msgpack.packb({"v": v, "t": t, "b": {"nonce": 1} if b is None else b})


@pytest.mark.parametrize(
    "frame, needle",
    [
        # random bytes, new each run; the id names them (pytest-xdist's workers must collect the same ids)
        pytest.param(os.urandom(64), "not valid msgpack|not a message envelope", id="64-random-bytes"),
        (b"", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "not a message envelope"),
        (envelope(v=99), "protocol version 99"),
        (envelope(t="launch_missiles"), "unknown message type 'launch_missiles'"),
        (envelope(b={}), "missing field 'nonce'"),
        (envelope(b={"nonce": "one"}), r"ping.nonce: expected int, got str"),
        (envelope(b={"nonce": True}), r"ping.nonce: expected int, got bool"),
        (envelope(b={"nonce": 1, "extra": 2}), "unknown field 'extra'"),
        (
            envelope(t="batch_plan", b={"step": 0, "sample_ids": ["a", 3], "group_ids": [], "scores": []}),
            r"batch_plan.sample_ids: expected list\[str\]",
        ),
        (b"\x00" * (M.MAX_MESSAGE_BYTES + 1), "exceeds"),
        (
            envelope(t="reward_result", b=_group_body(scores=[1.0, True])),
            r"reward_result.scores: expected list\[float\], got list \[1.0, True\]",
        ),
        (
            envelope(t="reward_result", b=_group_body(scores=[1.0, None])),
            r"reward_result.scores: expected list\[float\], got list \[1.0, None\]",
        ),
        (envelope(t="reward_result", b=_group_body(statuses=["ok", 7])), r"statuses: expected list\[str\]"),
        (
            envelope(t="reward_result", b=_group_body(details=["", None])),
            r"reward_result.details: expected list\[str\], got list \['', None\]",
        ),
        (
            envelope(t="trajectory_ready", b=dict(SAMPLES["trajectory_ready"].to_body(), version_max=[2, 1.0])),
            r"trajectory_ready.version_max: expected list\[int\], got list \[2, 1.0\]",
        ),
    ],
)
def test_malformed_frames_are_rejected_with_a_clear_error(frame, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(frame)


@pytest.mark.parametrize(
    "body, needle",
    [
        (_group_body(scores=[1.0]), r"reward_result: parallel lists differ in length: sample_ids=2, scores=1"),
        (_group_body(sample_ids=[], scores=[], statuses=[], details=[]), "reward_result: sample_ids is empty"),
    ],
)
def test_group_messages_with_inconsistent_lists_are_rejected(body, needle):
    """Per-group messages carry one entry per sample in parallel lists; a mismatch would pair a
    score with the wrong sample, so it is refused on decode and on encode."""
    with pytest.raises(ProtocolError, match=needle):
        decode(envelope(t="reward_result", b=body))
    with pytest.raises(ProtocolError, match=needle):
        encode(M.RewardResult(**body))
    with pytest.raises(ProtocolError, match="trajectory_ready: parallel lists differ in length"):
        encode(
            M.TrajectoryReady(
                group_id="g",
                worker_id="r",
                n_prompt_tokens=1,
                sample_ids=["g.0", "g.1"],
                n_output_tokens=[1, 2],
                version_min=[0, 0],
                version_max=[0],
                finish_reasons=["stop"] * 2,
            )
        )
    with pytest.raises(ProtocolError, match="reward_request: parallel lists differ in length"):
        encode(M.RewardRequest(group_id="g", sample_ids=["g.0"], completions=["a", "b"], solutions=["1"]))


# --------------------------------------------------------------------------------------------
# the generic batch envelope: several messages of one type in one frame
# --------------------------------------------------------------------------------------------

READY = [  # an engine step's two groups, each as it would come alone (written out by hand)
    M.TrajectoryReady("g1", "r0", 3, ["g1.0", "g1.1"], [4, 0], [1, -1], [2, -1], ["stop", "length"]),
    M.TrajectoryReady("g2", "r0", 5, ["g2.0"], [7], [2], [3], ["stop"], turns=[2]),
]


def _ready_columns(**over):
    """The wire form of a Batch of READY, by hand: one column a field, under the field's own name."""
    columns = {
        "group_id": ["g1", "g2"],
        "worker_id": ["r0", "r0"],
        "n_prompt_tokens": [3, 5],
        "sample_ids": [["g1.0", "g1.1"], ["g2.0"]],
        "n_output_tokens": [[4, 0], [7]],
        "version_min": [[1, -1], [2]],
        "version_max": [[2, -1], [3]],
        "finish_reasons": [["stop", "length"], ["stop"]],
        "turns": [[], [2]],
    }
    return {**columns, **over}


def test_a_batch_is_each_message_as_it_would_come_alone():
    """A hand-written batch frame decodes to the hand-written messages; ``Batch.of`` those messages
    encodes to exactly that frame's map."""
    frame = envelope(t="batch", b={"kind": "trajectory_ready", "columns": _ready_columns()})
    msg = decode(frame)
    assert isinstance(msg, M.Batch) and msg.kind == "trajectory_ready" and msg.size == 2
    assert msg.items() == READY and msg.item_type is M.TrajectoryReady
    assert msgpack.unpackb(encode(M.Batch.of(READY))) == msgpack.unpackb(frame)
    assert decode(encode(M.Batch.of(READY))).items() == READY


def test_one_message_goes_alone_several_in_a_batch_and_either_unpacks_to_messages():
    assert M.batched(READY[:1]) is READY[0] and M.unbatch(READY[0]) == [READY[0]]
    assert isinstance(M.batched(READY), M.Batch) and M.unbatch(M.batched(READY)) == READY


@pytest.mark.parametrize(
    "kind, columns, needle",
    [
        ("launch_missiles", _ready_columns(), r"batch: kind 'launch_missiles' is not a message type a batch carries"),
        ("batch", {"kind": ["ping"], "columns": [{}]}, r"kind 'batch' is not a message type a batch carries"),
        ("heartbeat", {"worker_id": ["r0"], "ts": [1.0]}, r"columns of heartbeat: missing \['stats'\], unknown \[\]"),
        ("ping", {"nonce": [1], "extra": [2]}, r"columns of ping: missing \[\], unknown \['extra'\]"),
        ("ping", {"nonce": 1}, r"batch: ping.nonce \(a column\): expected a list, got int"),
        ("ping", {"nonce": []}, r"batch: no items"),
        (
            "trajectory_ready",
            _ready_columns(n_prompt_tokens=[3]),
            r"batch: columns differ in length: group_id=2, worker_id=2, n_prompt_tokens=1, sample_ids=2",
        ),
        (
            "trajectory_ready",
            _ready_columns(n_output_tokens=[[4, 0], [True]]),
            r"batch: trajectory_ready.n_output_tokens \(a column\): expected list\[list\[int\]\], got list",
        ),
        ("ping", {"nonce": [1, "2"]}, r"batch: ping.nonce \(a column\): expected list\[int\], got list \[1, '2'\]"),
        (
            "trajectory_ready",
            _ready_columns(version_max=[[2], [3]]),
            (
                r"batch: trajectory_ready #0 \(group_id 'g1'\): parallel lists differ in length: sample_ids=2, "
                r"n_output_tokens=2, version_min=2, version_max=1, finish_reasons=2"
            ),
        ),
        (
            "trajectory_ready",
            _ready_columns(sample_ids=[["g1.0", "g1.1"], []], n_output_tokens=[[4, 0], []], version_min=[[1, -1], []],
                           version_max=[[2, -1], []], finish_reasons=[["stop", "length"], []], turns=[[], []]),
            r"batch: trajectory_ready #1 \(group_id 'g2'\): sample_ids is empty",
        ),
        (
            "trajectory_ready",
            _ready_columns(turns=[[], [2, 1]]),
            r"batch: trajectory_ready #1 \(group_id 'g2'\): turns has 2 entries for 1 samples \(expected none or one",
        ),
        ("trajectory_ready", _ready_columns(group_id=["g1", "g1"]), r"batch: trajectory_ready.group_id 'g1' repeats"),
        (
            "reward_result",
            {"group_id": ["g1", "g2"], "worker_id": ["w", "w"], "sample_ids": [["g1.0"], ["g2.0"]],
             "scores": [[1.0], [0.5, 1.0]], "statuses": [["ok"], ["ok"]], "details": [[""], [""]]},
            r"batch: reward_result #1 \(group_id 'g2'\): parallel lists differ in length: sample_ids=1, scores=2",
        ),
        (
            "groups_stopped",  # a type with a validate of its own: each item's decides (no KEY: numbered only)
            {"worker_id": ["r0", "r0"], "group_ids": [["g1"], ["g2"]], "n_output_tokens": [[3], [-1]],
             "reason": ["", ""]},
            r"batch: groups_stopped #1: n_output_tokens \[-1\]: expected counts >= 0",
        ),
    ],
)  # fmt: skip
def test_a_bad_batch_is_refused_naming_the_column_or_the_item(kind, columns, needle):
    """A batch is checked as if each message had come alone: columns complete and even, each typed as a
    list of its field's type, each message consistent (named by its group), no group twice. Refused on
    decode and on encode alike."""
    with pytest.raises(ProtocolError, match=needle):
        decode(envelope(t="batch", b={"kind": kind, "columns": columns}))
    with pytest.raises(ProtocolError, match=needle):
        encode(M.Batch(kind=kind, columns=columns))


def test_a_batch_is_made_of_one_control_message_type():
    scored = M.RewardResult("g1", "w", ["g1.0"], [1.0], ["ok"], [""])
    with pytest.raises(ValueError, match="one message type: trajectory_ready and reward_result given"):
        M.Batch.of([READY[0], scored])
    for bad in ([], [M.Batch.of(READY)], [ShmRetire(segs=["s"])]):  # none, a batch of batches, a side format
        with pytest.raises(ValueError, match="a batch carries one or more control messages"):
            M.Batch.of(bad)


def test_a_receiver_takes_batches_only_of_the_types_it_expects():
    """``Batch`` in ``expect``: batches of the other types named there; without it, no batch at all."""
    frame = encode(M.Batch.of(READY))
    assert decode(frame, expect=(M.TrajectoryReady, M.Batch)).items() == READY
    with pytest.raises(ProtocolError, match=r"unexpected batch of 'trajectory_ready' here \(expected reward_request"):
        decode(frame, expect=(M.RewardRequest, M.Batch))
    with pytest.raises(ProtocolError, match="unexpected message type 'batch' here"):
        decode(frame, expect=(M.TrajectoryReady,))


@pytest.mark.parametrize(
    "frame, needle",
    [
        (envelope(t="trajectories_ready", b={}), "unknown message type 'trajectories_ready'"),
        (envelope(t="reward_results", b={}, v=2), r"protocol version 2 is not supported \(this side speaks 3\)"),
    ],
)
def test_a_peer_of_the_plural_types_gets_a_clear_refusal(frame, needle):
    """Protocol 2's plural twins (generate_requests, trajectories_ready, reward_requests, reward_results)
    are gone in 3: such a frame is refused by its version, or by its type name."""
    assert PROTOCOL_VERSION == 3
    with pytest.raises(ProtocolError, match=needle):
        decode(frame)


def test_a_group_with_no_samples_is_refused_alone_as_in_a_batch():
    body = dict(SAMPLES["generate_request"].to_body(), sample_ids=[])
    with pytest.raises(ProtocolError, match="generate_request: sample_ids is empty"):
        decode(envelope(t="generate_request", b=body))
    columns = {k: [v, v] for k, v in SAMPLES["generate_request"].to_body().items()}
    columns["group_id"], columns["sample_ids"] = ["g1", "g2"], [["g1.0"], []]
    with pytest.raises(ProtocolError, match=r"generate_request #1 \(group_id 'g2'\): sample_ids is empty"):
        decode(envelope(t="batch", b={"kind": "generate_request", "columns": columns}))


def test_unexpected_type_is_rejected_where_a_specific_one_is_expected():
    with pytest.raises(ProtocolError, match="unexpected message type 'ping'"):
        decode(encode(M.Ping(nonce=1)), expect=(M.RewardRequest,))


def test_list_fields_take_int_subclasses_and_ints_as_floats_but_never_bools():
    """The per-sample list check's fast path (exact types) falls back to the item-by-item rule."""
    import enum

    class Tok(enum.IntEnum):
        EOS = 2

    msg = decode(envelope(t="reward_result", b=_group_body(scores=[1, 0.5])))
    assert msg.scores == [1, 0.5]
    ready = M.TrajectoryReady("g", "r", 1, ["g.0"], [Tok.EOS], [0], [0], ["stop"])
    assert decode(encode(ready)).n_output_tokens == [2]
    with pytest.raises(ProtocolError, match=r"trajectory_ready.version_min: expected list\[int\], got list \[False\]"):
        encode(M.TrajectoryReady("g", "r", 1, ["g.0"], [3], [False], [0], ["stop"]))


def test_encode_refuses_mistyped_fields():
    with pytest.raises(ProtocolError, match="register_ack.version: expected int"):
        encode(M.RegisterAck(worker_id="x", version="3"))


def test_pickle_is_never_accepted():
    import pickle

    with pytest.raises(ProtocolError):
        decode(pickle.dumps(M.Ping(nonce=1)))


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4),
        torch.arange(5, dtype=torch.int64),
        torch.tensor(3.5),
        torch.zeros(0, 7),
        torch.ones(2, 2, dtype=torch.bfloat16),
        torch.tensor([True, False]),
    ],
)
def test_tensor_frames_round_trip_bit_exactly(t):
    key, meta, out = decode_tensors(encode_tensors("k", {"g": 1}, {"x": t}))
    assert (key, meta) == ("k", {"g": 1})
    assert out["x"].dtype == t.dtype and out["x"].shape == t.shape
    raw = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731  bit-exact, NaN-safe comparison
    assert torch.equal(raw(out["x"]), raw(t))


def test_truncated_and_mislabelled_tensor_frames_are_rejected():
    frames = encode_tensors("k", {}, {"x": torch.randn(4), "y": torch.arange(3)})
    with pytest.raises(ProtocolError, match="needs 16 bytes"):
        decode_tensors([frames[0], bytes(frames[1])[:10], frames[2]])
    with pytest.raises(ProtocolError, match="header lists 2 tensors, got 1 frames"):
        decode_tensors(frames[:2])
    header = msgpack.unpackb(frames[0])
    header["specs"][0]["dtype"] = "complex128"
    with pytest.raises(ProtocolError, match="unsupported dtype 'complex128'"):
        decode_tensors([msgpack.packb(header)] + frames[1:])
    with pytest.raises(ProtocolError, match="expected a tensors frame, got type 'ping'"):
        decode_tensors([encode(M.Ping(nonce=1))])


async def test_router_receiver_keeps_serving_after_bad_frames(caplog, tmp_path):
    """A ROUTER server answering Ping: garbage in between is logged and answered with Error."""
    ctx = zmq.asyncio.Context()
    ep = f"ipc://{tmp_path}/s.sock"
    server = make_socket(ctx, zmq.ROUTER, bind=ep)
    client = make_socket(ctx, zmq.DEALER, connect=ep, identity="c1")

    async def serve():
        while True:
            ident, msg = await recv_message(server, routed=True, where="test-server")
            reply = M.Pong(nonce=msg.nonce) if isinstance(msg, M.Ping) else M.Error(code="bad_frame", detail="")
            await send_message(server, reply, to=ident)

    task = asyncio.create_task(serve())
    bad = [os.urandom(32), envelope(v=7), envelope(t="nope"), envelope(b={"nonce": "x"}), b""]
    with caplog.at_level(logging.ERROR, logger="areal_async.protocols"):
        for frame in bad:
            await client.send(frame)
            assert isinstance(decode(await asyncio.wait_for(client.recv(), 5)), M.Error)
        await send_message(client, M.Ping(nonce=42))
        assert decode(await asyncio.wait_for(client.recv(), 5)) == M.Pong(nonce=42)
    rejected = [r for r in caplog.records if "rejected a frame" in r.getMessage()]
    assert len(rejected) == len(bad)
    task.cancel()
    ctx.destroy(linger=0)
