"""Wire protocol: typed msgpack messages, tensor frames, and receivers that survive bad frames."""

import asyncio
import dataclasses
import logging
import os

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import PROTOCOL_VERSION, REGISTRY, ProtocolError, decode, encode
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
    "generate_requests": M.GenerateRequests(
        group_ids=["g1", "g2"],
        prompt_keys=["e0p1", "e0p2"],
        sample_ids=[["g1.0", "g1.1"], ["g2.0", "g2.1"]],
        prompt_tokens=[[1, 5, 6], [1, 7]],
        solutions=[["7"], ["8", "eight"]],
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
    "trajectories_ready": M.TrajectoriesReady(
        worker_id="r0",
        group_ids=["g1", "g2"],
        n_prompt_tokens=[3, 5],
        sample_ids=[["g1.0", "g1.1"], ["g2.0"]],
        n_output_tokens=[[4, 0], [7]],
        version_min=[[1, -1], [2]],
        version_max=[[2, -1], [3]],
        finish_reasons=[["stop", "length"], ["stop"]],
    ),
    "reward_request": M.RewardRequest(
        group_id="g1", sample_ids=["g1.0", "g1.1"], completions=["\\boxed{7}", ""], solutions=["7"]
    ),
    "reward_requests": M.RewardRequests(
        group_ids=["g1", "g2"],
        sample_ids=[["g1.0", "g1.1"], ["g2.0"]],
        completions=[["\\boxed{7}", ""], ["8"]],
        solutions=[["7"], ["8", "eight"]],
    ),
    "reward_result": M.RewardResult(
        group_id="g1",
        worker_id="w",
        sample_ids=["g1.0", "g1.1"],
        scores=[1.0, 0.0],
        statuses=["ok", "timeout"],
        details=["", "killed after 5.0 s"],
    ),
    "reward_results": M.RewardResults(
        worker_id="w",
        group_ids=["g1", "g2"],
        sample_ids=[["g1.0", "g1.1"], ["g2.0"]],
        scores=[[1.0, 0.0], [0.5]],
        statuses=[["ok", "timeout"], ["ok"]],
        details=[["", "killed after 5.0 s"], [""]],
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
        (os.urandom(64), "not valid msgpack|not a message envelope"),
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


def _results_body(**over):
    body = {
        "worker_id": "w",
        "group_ids": ["g1", "g2"],
        "sample_ids": [["g1.0", "g1.1"], ["g2.0"]],
        "scores": [[1.0, 0.0], [0.5]],
        "statuses": [["ok", "ok"], ["ok"]],
        "details": [["", ""], [""]],
    }
    return {**body, **over}


@pytest.mark.parametrize(
    "body, needle",
    [
        (
            _results_body(scores=[[1.0, 0.0]]),
            r"reward_results: parallel lists differ in length: group_ids=2, .*scores=1",
        ),
        (_results_body(group_ids=[], sample_ids=[], scores=[], statuses=[], details=[]), "group_ids is empty"),
        (
            _results_body(scores=[[1.0, 0.0], [0.5, 1.0]]),
            r"reward_results: group 'g2' \(#1\): sample_ids=1, scores=2, statuses=1, details=1: expected equal",
        ),
        (_results_body(statuses=[[], ["ok"]]), r"group 'g1' \(#0\): sample_ids=2, scores=2, statuses=0, details=2"),
        (
            _results_body(
                sample_ids=[["g1.0", "g1.1"], []],
                scores=[[1.0, 0.0], []],
                statuses=[["ok", "ok"], []],
                details=[["", ""], []],
            ),
            r"group 'g2' \(#1\): sample_ids=0, scores=0, statuses=0, details=0: expected equal and > 0",
        ),
        (_results_body(scores=[[1.0, "0"], [0.5]]), r"reward_results.scores: expected list\[list\[float\]\]"),
    ],
)
def test_reward_results_with_inconsistent_lists_are_rejected_naming_the_group(body, needle):
    """Several groups' scores in one message: a list that does not line up with its group's samples
    would pair a score with the wrong sample, so it is refused on decode and on encode."""
    with pytest.raises(ProtocolError, match=needle):
        decode(envelope(t="reward_results", b=body))
    with pytest.raises(ProtocolError, match=needle):
        encode(M.RewardResults(**body))


def test_generate_requests_split_into_one_request_per_group_and_back():
    m = SAMPLES["generate_requests"]
    shared = dict(min_version=2, max_new_tokens=8, temperature=0.7, top_p=0.9, greedy=False, stop_token_ids=[2])
    reqs = [
        M.GenerateRequest("g1", "e0p1", ["g1.0", "g1.1"], [1, 5, 6], ["7"], **shared),
        M.GenerateRequest("g2", "e0p2", ["g2.0", "g2.1"], [1, 7], ["8", "eight"], **shared),
    ]
    assert m.requests() == reqs
    assert M.GenerateRequests.of(reqs) == m
    other = dataclasses.replace(reqs[1], min_version=3)
    with pytest.raises(ValueError, match=r"group 'g2' has min_version=3, group 'g1' 2: one GenerateRequests"):
        M.GenerateRequests.of([reqs[0], other])


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"prompt_keys": ["e0p1"]}, r"generate_requests: parallel lists differ in length: group_ids=2, prompt_keys=1"),
        ({"sample_ids": [["g1.0"], []]}, r"generate_requests: group 'g2' \(#1\) has no sample_ids"),
        ({"prompt_tokens": [[1], ["x"]]}, r"generate_requests.prompt_tokens: expected list\[list\[int\]\]"),
    ],
)
def test_generate_requests_with_inconsistent_lists_are_rejected_naming_the_group(over, needle):
    body = {**SAMPLES["generate_requests"].to_body(), **over}
    with pytest.raises(ProtocolError, match=needle):
        decode(envelope(t="generate_requests", b=body))


def _requests_body(**over):
    body = {
        "group_ids": ["g1", "g2"],
        "sample_ids": [["g1.0", "g1.1"], ["g2.0"]],
        "completions": [["a", "b"], ["c"]],
        "solutions": [["1"], ["2"]],
    }
    return {**body, **over}


@pytest.mark.parametrize(
    "body, needle",
    [
        (_requests_body(solutions=[["1"]]), r"reward_requests: parallel lists differ in length: .*solutions=1"),
        (_requests_body(completions=[["a"], ["c"]]), r"group 'g1' \(#0\): sample_ids=2, completions=1: expected"),
        (_requests_body(sample_ids=[["g1.0", "g1.1"], []], completions=[["a", "b"], []]), r"group 'g2' \(#1\)"),
        (_requests_body(solutions=[["1"], "2"]), r"reward_requests.solutions: expected list\[list\[str\]\]"),
    ],
)
def test_reward_requests_with_inconsistent_lists_are_rejected_naming_the_group(body, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(envelope(t="reward_requests", b=body))
    with pytest.raises(ProtocolError, match=needle):
        encode(M.RewardRequests(**body))


def test_reward_requests_split_into_one_request_per_group_and_back():
    m = SAMPLES["reward_requests"]
    reqs = [
        M.RewardRequest("g1", ["g1.0", "g1.1"], ["\\boxed{7}", ""], ["7"]),
        M.RewardRequest("g2", ["g2.0"], ["8"], ["8", "eight"]),
    ]
    assert m.requests() == reqs
    assert M.RewardRequests.of(reqs) == m
    assert m.prompts == [] and all(r.prompt == "" for r in m.requests())  # no question sent: none on the wire
    asked = [dataclasses.replace(reqs[0], prompt="3+4="), dataclasses.replace(reqs[1], prompt="4+4=")]
    both = M.RewardRequests.of(asked)
    assert both.prompts == ["3+4=", "4+4="] and decode(encode(both)).requests() == asked
    with pytest.raises(ProtocolError, match="1 prompts for 2 groups: expected none or one a group"):
        encode(dataclasses.replace(both, prompts=["3+4="]))


def test_reward_results_split_into_one_result_per_group():
    m = SAMPLES["reward_results"]
    assert m.results() == [
        M.RewardResult("g1", "w", ["g1.0", "g1.1"], [1.0, 0.0], ["ok", "timeout"], ["", "killed after 5.0 s"]),
        M.RewardResult("g2", "w", ["g2.0"], [0.5], ["ok"], [""]),
    ]


def test_trajectories_ready_is_one_trajectory_ready_per_group():
    """An engine step's groups in one message: decoded, each group is the TrajectoryReady a
    rollout worker would have sent for it alone (values written out by hand)."""
    msg = decode(encode(SAMPLES["trajectories_ready"]))
    assert msg.groups() == [
        M.TrajectoryReady("g1", "r0", 3, ["g1.0", "g1.1"], [4, 0], [1, -1], [2, -1], ["stop", "length"]),
        M.TrajectoryReady("g2", "r0", 5, ["g2.0"], [7], [2], [3], ["stop"]),
    ]


def _ready_body(**over):
    body = SAMPLES["trajectories_ready"].to_body()
    body.update(over)
    return body


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"n_prompt_tokens": [3]}, r"parallel lists differ in length: group_ids=2, n_prompt_tokens=1"),
        (
            {
                "group_ids": [],
                "n_prompt_tokens": [],
                "sample_ids": [],
                "n_output_tokens": [],
                "version_min": [],
                "version_max": [],
                "finish_reasons": [],
            },
            "group_ids is empty",
        ),
        ({"group_ids": ["g1", "g1"]}, r"group_ids repeat a group: \['g1', 'g1'\]"),
        ({"version_max": [[2], [3]]}, r"group 'g1': parallel lists differ in length: sample_ids=2, .*version_max=1"),
        (
            {
                "sample_ids": [["g1.0", "g1.1"], []],
                "n_output_tokens": [[4, 0], []],
                "version_min": [[1, -1], []],
                "version_max": [[2, -1], []],
                "finish_reasons": [["stop", "length"], []],
            },
            "group 'g2': sample_ids is empty",
        ),
        ({"n_output_tokens": [[4, 0], [True]]}, r"n_output_tokens: expected list\[list\[int\]\]"),
    ],
)
def test_trajectories_ready_with_bad_lists_is_rejected(over, needle):
    """Per group and per sample the lists must pair up (else a sample would be booked with another's
    counts), a group appears once, and the items are typed; refused on decode and on encode."""
    with pytest.raises(ProtocolError, match="trajectories_ready.*" + needle):
        decode(envelope(t="trajectories_ready", b=_ready_body(**over)))
    with pytest.raises(ProtocolError, match="trajectories_ready.*" + needle):
        encode(M.TrajectoriesReady(**_ready_body(**over)))


def test_trajectories_ready_of_joins_one_workers_groups_and_refuses_others():
    groups = SAMPLES["trajectories_ready"].groups()
    assert M.TrajectoriesReady.of(groups) == SAMPLES["trajectories_ready"]
    other = dataclasses.replace(groups[1], worker_id="r1")
    with pytest.raises(ValueError, match=r"group 'g2' has worker 'r1', not 'r0'"):
        M.TrajectoriesReady.of([groups[0], other])
    episodes = dataclasses.replace(groups[1], turns=[2])
    with pytest.raises(ValueError, match=r"group 'g2' has turns \[2\]: a TrajectoriesReady carries neither"):
        M.TrajectoriesReady.of([groups[0], episodes])


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
