"""The side formats of ``protocols.side``: typed round trips, the pre-typing wire bytes, and the same
refusals as control messages (hand-built bad payloads, each error naming the field); the receivers
(reward child, zmq weight publisher, tensor channel) keep serving after a bad frame.

The expected bytes are msgpack maps written out by hand in the layout each format had before it was
typed (``{"v", "t", <fields>}``, or the bare field map on the reward pipe), not produced by the code
under test.
"""

import os
import subprocess
import sys
import time

import msgpack
import pytest
import torch
import zmq

from protocols.messages import PROTOCOL_VERSION, Ping, ProtocolError, decode, encode
from protocols.side import (
    GroupTensors,
    IpcTensors,
    RewardInit,
    RewardReady,
    RewardReply,
    RewardTasks,
    ShmRetire,
    ShmTensors,
    TensorHeader,
    WeightFetch,
)
from protocols.sockets import make_socket

from areal_async.reward._wire import HEADER, encode_frame
from areal_async.transport import TransportError, make_tensor_channel, make_weight_channel
from areal_async.transport.zmq_channel import _bucket_reply

V = PROTOCOL_VERSION
SPEC = {"name": "x", "dtype": "int32", "shape": [2], "nbytes": 8}

# (message, the same message as the plain map it travelled as before it was typed)
ROUND_TRIPS = [
    (
        TensorHeader(key="k", meta={"g": 1}, specs=[SPEC]),
        {"v": V, "t": "tensors", "key": "k", "meta": {"g": 1}, "specs": [SPEC]},
    ),
    (
        ShmTensors(seg="areal_ab_0", size=8192, pooled=True, offsets=[0, 64], sizes=[8, 0], header=b"h"),
        {
            "v": V,
            "t": "shm_tensors",
            "seg": "areal_ab_0",
            "size": 8192,
            "pooled": True,
            "offsets": [0, 64],
            "sizes": [8, 0],
            "header": b"h",
        },
    ),
    (ShmRetire(segs=["areal_ab_0", "areal_ab_1"]), {"v": V, "t": "shm_retire", "segs": ["areal_ab_0", "areal_ab_1"]}),
    (
        GroupTensors(src=2, sizes=[16], header=b"h"),
        {"v": V, "t": "group_tensors", "src": 2, "sizes": [16], "header": b"h"},
    ),
    (
        IpcTensors(ipc=None, offsets=[], sizes=[], header=b"h"),
        {"v": V, "t": "ipc_tensors", "ipc": None, "offsets": [], "sizes": [], "header": b"h"},
    ),
    (
        IpcTensors(ipc={"device": 0, "handle": b"\x01"}, offsets=[0], sizes=[4], header=b"h"),
        {
            "v": V,
            "t": "ipc_tensors",
            "ipc": {"device": 0, "handle": b"\x01"},
            "offsets": [0],
            "sizes": [4],
            "header": b"h",
        },
    ),
    (WeightFetch(version=3, bucket=7), {"v": V, "t": "weight_fetch", "version": 3, "bucket": 7}),
    (
        RewardInit(fn="m:f", kwargs={"precision": 6}, memory_limit_mb=0),
        {"fn": "m:f", "kwargs": {"precision": 6}, "memory_limit_mb": 0},
    ),
    (RewardReady(ready=True, pid=42), {"ready": True, "pid": 42}),
    (RewardReady(ready=False, error="no module m"), {"ready": False, "error": "no module m"}),
    (
        RewardTasks(completions=["\\boxed{2}", "3"], solutions=[["2"], ["3", "three"]]),
        {"completions": ["\\boxed{2}", "3"], "solutions": [["2"], ["3", "three"]]},
    ),
    (
        RewardTasks(completions=["2"], solutions=[["2"]], prompts=["1+1="]),  # with the questions (a judge)
        {"completions": ["2"], "solutions": [["2"]], "prompts": ["1+1="]},
    ),
    (RewardReply(score=1.0), {"score": 1.0}),
    (RewardReply(error="ZeroDivisionError: x"), {"error": "ZeroDivisionError: x"}),
]


@pytest.mark.parametrize("msg,old", ROUND_TRIPS, ids=lambda x: type(x).__name__ if not isinstance(x, dict) else "")
def test_side_message_round_trips_in_its_old_wire_layout(msg, old):
    data = encode(msg)
    assert data == msgpack.packb(old, use_bin_type=True)  # byte for byte what the untyped code sent
    assert decode(data, (type(msg),)) == msg


def _bad(fields: dict, **over) -> bytes:
    return msgpack.packb({**fields, **over}, use_bin_type=True)


NOTE = {
    "v": V,
    "t": "shm_tensors",
    "seg": "s",
    "size": 8192,
    "pooled": True,
    "offsets": [0],
    "sizes": [8],
    "header": b"h",
}
BAD = [  # (bytes, expected types, words the error must contain)
    (b"\xc1garbage", (ShmTensors,), "not valid msgpack"),
    (b"\x92\x01\x02", (ShmTensors,), "shm_tensors frame is list [1, 2], expected a map"),
    (_bad(NOTE, size="8192"), (ShmTensors,), "shm_tensors.size: expected int, got str '8192'"),
    (_bad(NOTE, pooled=1), (ShmTensors,), "shm_tensors.pooled: expected bool, got int"),
    (_bad(NOTE, offsets=[0, "8"]), (ShmTensors,), "shm_tensors.offsets: expected list[int]"),
    (_bad(NOTE, offsets=[-64]), (ShmTensors,), "shm_tensors: offsets has a negative entry -64"),
    (_bad(NOTE, extra=1), (ShmTensors,), "shm_tensors: unknown field 'extra'"),
    (_bad({k: v for k, v in NOTE.items() if k != "seg"}), (ShmTensors,), "shm_tensors: missing field 'seg'"),
    (_bad(NOTE, v=V + 1), (ShmTensors,), f"protocol version {V + 1} is not supported"),
    (
        _bad(NOTE, t="shm_tensor"),
        (ShmTensors, ShmRetire),
        "expected a shm_tensors or shm_retire frame, got type 'shm_tensor'",
    ),
    (
        _bad({"v": V, "t": "shm_retire", "segs": ["a", 3]}),
        (ShmTensors, ShmRetire),
        "shm_retire.segs: expected list[str]",
    ),
    (
        encode(WeightFetch(version=1, bucket=0)),
        (GroupTensors,),
        "expected a group_tensors frame, got type 'weight_fetch'",
    ),
    (
        _bad({"v": V, "t": "group_tensors", "src": 1.5, "sizes": [], "header": b""}),
        (GroupTensors,),
        "group_tensors.src: expected int, got float 1.5",
    ),
    (
        _bad({"v": V, "t": "ipc_tensors", "ipc": [], "offsets": [], "sizes": [], "header": b""}),
        (IpcTensors,),
        "ipc_tensors.ipc: expected Optional[dict], got list",
    ),
    (
        _bad({"v": V, "t": "ipc_tensors", "offsets": [], "sizes": [], "header": b""}),
        (IpcTensors,),
        "ipc_tensors: missing field 'ipc'",
    ),
    (
        _bad({"v": V, "t": "tensors", "key": 5, "meta": {}, "specs": []}),
        (TensorHeader,),
        "tensors.key: expected str, got int 5",
    ),
    (
        _bad({"v": V, "t": "tensors", "key": "k", "meta": {}, "specs": [{}] * 65537}),
        (TensorHeader,),
        "tensors: header lists 65537 tensors (limit 65536)",
    ),
    (b"\x00" * (4096 + 1), (WeightFetch,), "frame of 4097 bytes exceeds the 4096-byte limit"),
    (_bad({"fn": "m:f", "kwargs": [], "memory_limit_mb": 0}), (RewardInit,), "reward_init.kwargs: expected dict"),
    (_bad({"ready": True}), (RewardReady,), "reward_ready: ready without a pid"),
    (_bad({"ready": "yes", "pid": 1}), (RewardReady,), "reward_ready.ready: expected bool, got str"),
    (
        _bad({"completions": ["c"], "solutions": "2"}),
        (RewardTasks,),
        "reward_tasks.solutions: expected list[list[str]], got str",
    ),
    (
        _bad({"completions": ["c"], "solutions": [["2"], 2]}),
        (RewardTasks,),
        "reward_tasks.solutions: expected list[list[str]], got list",
    ),
    (_bad({"completions": ["c"], "solutions": [[]], "n": 1}), (RewardTasks,), "reward_tasks: unknown field 'n'"),
    (
        _bad({"completions": ["c", "d"], "solutions": [[], []], "prompts": ["q"]}),
        (RewardTasks,),
        "reward_tasks: 2 completions but 1 prompts: expected one each",
    ),
    (
        _bad({"completions": ["c", "d"], "solutions": [["2"]]}),
        (RewardTasks,),
        "reward_tasks: 2 completions but 1 solution lists: expected one each",
    ),
    (_bad({"completions": [], "solutions": []}), (RewardTasks,), "reward_tasks: no completions"),
    (_bad({"score": 1.0, "error": "x"}), (RewardReply,), "reward_reply: expected exactly one of score and error"),
    (_bad({}), (RewardReply,), "reward_reply: expected exactly one of score and error"),
    (_bad({"score": "1"}), (RewardReply,), "reward_reply.score: expected Optional[float], got str"),
]


@pytest.mark.parametrize("data,expect,words", BAD, ids=[w[:40] for _, _, w in BAD])
def test_bad_side_frames_are_refused_naming_the_problem(data, expect, words):
    with pytest.raises(ProtocolError) as err:
        decode(data, expect)
    assert words in str(err.value)


def test_side_and_control_decoding_do_not_cross():
    with pytest.raises(ProtocolError, match=r"not a message envelope \{v, t, b\}"):
        decode(encode(WeightFetch(version=1, bucket=0)))  # a side frame is no control message
    with pytest.raises(TypeError, match="mixes side formats and control messages"):
        decode(b"", (Ping, WeightFetch))
    with pytest.raises(TypeError, match="expect exactly one"):
        decode(b"", (RewardReply, RewardReady))  # bare maps carry no type name to tell them apart
    with pytest.raises(ProtocolError, match="weight_fetch.bucket: expected int, got str"):
        encode(WeightFetch(version=1, bucket="0"))  # checked on the way out too


# ---- receivers keep serving after a bad frame -----------------------------------------------------------


def _child(fn: str = "tests.support.reward_fixtures:exact_match"):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(
        [sys.executable, "-m", "areal_async.reward._child", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )


def _talk(proc, frame: bytes) -> dict:
    proc.stdin.write(frame)
    proc.stdin.flush()
    return _reply(proc)


def _reply(proc) -> dict:
    (n,) = HEADER.unpack(proc.stdout.read(HEADER.size))
    return msgpack.unpackb(proc.stdout.read(n), raw=False)


def _raw_frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


@pytest.mark.timeout(60)
def test_reward_child_answers_bad_tasks_with_the_field_and_keeps_scoring():
    proc = _child()
    try:
        init = encode_frame(RewardInit(fn="tests.support.reward_fixtures:exact_match", kwargs={}, memory_limit_mb=0))
        assert _talk(proc, init) == {"ready": True, "pid": proc.pid}
        bad = [
            (_raw_frame(b"\xc1"), "not valid msgpack"),
            (_raw_frame(_bad({"completions": [7], "solutions": [["7"]]})), "reward_tasks.completions: expected list"),
            (_raw_frame(_bad({"completions": ["7"], "solutions": [["7"]], "x": 0})), "unknown field 'x'"),
            (_raw_frame(_bad({"completions": ["7"]})), "missing field 'solutions'"),
        ]
        for frame, words in bad:
            reply = _talk(proc, frame)
            assert set(reply) == {"error"} and words in reply["error"], reply
            assert _talk(proc, encode_frame(RewardTasks(completions=["7"], solutions=[["7"]]))) == {"score": 1.0}
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_reward_child_answers_a_frame_of_tasks_one_reply_each_in_order():
    proc = _child("tests.support.reward_fixtures:dispatch")
    try:
        init = encode_frame(RewardInit(fn="tests.support.reward_fixtures:dispatch", kwargs={}, memory_limit_mb=0))
        assert _talk(proc, init) == {"ready": True, "pid": proc.pid}
        tasks = RewardTasks(completions=["7", "raise_error", "8", "7"], solutions=[["7"], ["x"], ["9"], ["1", "7"]])
        proc.stdin.write(encode_frame(tasks))
        proc.stdin.flush()
        replies = [_reply(proc) for _ in range(4)]
        assert replies[0] == {"score": 1.0} and replies[2] == {"score": 0.0} and replies[3] == {"score": 1.0}
        assert set(replies[1]) == {"error"} and "RuntimeError: boom on 'raise_error'" in replies[1]["error"]
        assert _talk(proc, encode_frame(RewardTasks(completions=["8"], solutions=[["8"]]))) == {"score": 1.0}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_reward_child_refuses_a_bad_init_naming_the_field():
    proc = _child()
    try:
        reply = _talk(proc, _raw_frame(_bad({"fn": "tests.support.reward_fixtures:exact_match", "kwargs": {}})))
        assert reply == {"ready": False, "error": "bad init message: reward_init: missing field 'memory_limit_mb'"}
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
        proc.wait()


def test_reward_pool_refuses_a_malformed_reply_naming_the_field():
    from areal_async.reward.pool import _read_frame

    body = _bad({"score": "high"})
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.stdout.buffer.write({_raw_frame(body)!r})"], stdout=subprocess.PIPE
    )
    try:
        with pytest.raises(ProtocolError, match="reward_reply.score: expected Optional\\[float\\], got str 'high'"):
            _read_frame(proc, time.monotonic() + 30, RewardReply)
    finally:
        proc.wait()


@pytest.mark.timeout(60)
def test_weight_publisher_answers_a_bad_fetch_with_the_field_and_keeps_serving():
    pub = make_weight_channel("zmq", role="publisher", bucket_mb=0.0001)
    rx = make_weight_channel("zmq", role="receiver", timeout_s=10)
    sd = {"w": torch.arange(64, dtype=torch.float32)}
    m = pub.publish_begin(1, sd)
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, connect=m["handle"]["endpoint"])
    try:
        fetch = {"v": V, "t": "weight_fetch", "version": 1, "bucket": 0}
        for body, words in [
            (_bad(fetch, bucket="0"), "weight_fetch.bucket: expected int, got str"),
            (_bad(fetch, n=2), "weight_fetch: unknown field 'n'"),
            (_bad({k: v for k, v in fetch.items() if k != "version"}), "missing field 'version'"),
            (b"\xc1", "not valid msgpack"),
        ]:
            sock.send(body)
            with pytest.raises(TransportError, match="publisher refused bucket 0: .*" + words):
                _bucket_reply(sock, 1, 0, m["bucket_bytes"], 10)
        assert torch.equal(rx.receive(m)["w"], sd["w"])  # the server thread lives on
    finally:
        sock.close()
        rx.close()
        pub.close()


@pytest.mark.timeout(60)
def test_zmq_tensor_receiver_refuses_a_mistyped_header_and_keeps_serving():
    rx = make_tensor_channel("zmq", role="receiver", endpoint="tcp://127.0.0.1:*")
    tx = make_tensor_channel("zmq", role="sender", endpoint=rx.endpoint)
    raw = make_socket(zmq.Context.instance(), zmq.PUSH, connect=rx.endpoint)
    good = {"x": torch.arange(4, dtype=torch.int32)}
    spec = {"name": "x", "dtype": "int32", "shape": [4], "nbytes": 16}
    try:
        for header, words in [
            ({"v": V, "t": "tensors", "key": ["k"], "meta": {}, "specs": [spec]}, "tensors.key"),
            ({"v": V, "t": "tensors", "key": "k", "meta": {}, "specs": [spec], "x": 1}, "tensors: unknown field 'x'"),
            ({"v": V, "t": "tensors", "key": "k", "specs": [spec]}, "tensors: missing field 'meta'"),
        ]:
            raw.send_multipart([_bad(header), good["x"].numpy().tobytes()])
            with pytest.raises(ProtocolError, match=words):
                rx.recv(timeout_s=10)
            tx.send("after", good)
            key, _, got = rx.recv(timeout_s=10)
            assert key == "after" and torch.equal(got["x"], good["x"])
    finally:
        raw.close()
        tx.close()
        rx.close()
