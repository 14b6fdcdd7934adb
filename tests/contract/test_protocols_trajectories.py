"""The one trajectory batch layout (``protocols.trajectories``): round trips with values written out by
hand, one group as the one-group case of many, and every malformed message refused with a clear error,
over a real channel too (the trainer's buffer logs it, drops the message and goes on)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import zmq

from protocols.messages import ProtocolError
from protocols.sockets import ipc_endpoint
from protocols.tensors import encode_tensors
from protocols.trajectories import Trajectory, TrajectoryBatch

from areal_async.trainer.buffer import TrajectoryBuffer
from areal_async.transport.factory import make_tensor_channel

I32, F32 = torch.int32, torch.float32


def two_groups(mask: bool = False) -> TrajectoryBatch:
    """g0: prompt [1, 2, 3], samples a (outputs 5 6) and b (7); g1: prompt [4], sample c (8 9 10)."""
    g0 = TrajectoryBatch.group(
        "g0", ["a", "b"], [1, 2, 3], [2, 1], [5, 6, 7], [-0.5, -1.0, -1.5], [2, 2, 3], [1, 0, 1] if mask else None
    )
    g1 = TrajectoryBatch.group(
        "g1", ["c"], [4], [3], [8, 9, 10], [-2.0, -2.5, -3.0], [3, 3, 3], [1, 1, 1] if mask else None
    )
    return TrajectoryBatch.join([g0, g1])


def test_two_groups_encode_to_the_documented_layout_and_decode_to_views():
    key, t, meta = two_groups().encode()
    assert key == "g0" and meta == {
        "group_ids": ["g0", "g1"],
        "group_sizes": [2, 1],
        "prompt_lengths": [3, 1],
        "sample_ids": ["a", "b", "c"],
        "lengths": [2, 1, 3],
    }
    assert {k: (v.dtype, v.tolist()) for k, v in t.items()} == {
        "prompt_ids": (I32, [1, 2, 3, 4]),
        "output_ids": (I32, [5, 6, 7, 8, 9, 10]),
        "logprobs": (F32, [-0.5, -1.0, -1.5, -2.0, -2.5, -3.0]),
        "versions": (I32, [2, 2, 3, 3, 3, 3]),
    }
    a, b, c = TrajectoryBatch.decode(key, meta, t).samples()
    assert (a.sample_id, a.group_id, a.prompt_ids.tolist(), a.output_ids.tolist()) == ("a", "g0", [1, 2, 3], [5, 6])
    assert (b.group_id, b.prompt_ids.tolist(), b.logprobs.tolist(), b.versions.tolist()) == (
        "g0",
        [1, 2, 3],
        [-1.5],
        [3],
    )
    assert (c.group_id, c.prompt_ids.tolist(), c.output_ids.tolist()) == ("g1", [4], [8, 9, 10])
    assert c.output_ids.data_ptr() == t["output_ids"].data_ptr() + 3 * 4 and c.loss_mask is None  # views


def test_one_group_is_the_one_group_case_and_the_mask_travels_as_bool():
    key, t, meta = TrajectoryBatch.group(
        "g", ["s"], torch.tensor([7, 8]), [2], [1, 2], [-1.0, -2.0], [0, 0], [0, 1]
    ).encode()
    assert meta == {"group_ids": ["g"], "group_sizes": [1], "prompt_lengths": [2], "sample_ids": ["s"], "lengths": [2]}
    assert t["loss_mask"].dtype == torch.bool and t["prompt_ids"].dtype == I32
    (s,) = TrajectoryBatch.decode(key, meta, t).samples()
    assert s.loss_mask.tolist() == [False, True] and s.prompt_ids.tolist() == [7, 8]


def test_views_join_back_into_the_same_batch():
    for mask in (False, True):
        batch = two_groups(mask)
        back = TrajectoryBatch.of_samples(batch.samples())
        assert back.group_ids == ["g0", "g1"] and back.group_sizes == [2, 1] and back.sample_ids == ["a", "b", "c"]
        assert all(torch.equal(x, y) for x, y in zip(back.tensors().values(), batch.tensors().values()))
        assert list(back.tensors()) == list(batch.tensors())


def test_join_refuses_batches_with_and_without_a_mask():
    plain = TrajectoryBatch.group("p", ["x"], [1], [1], [2], [-1.0], [0])
    masked = TrajectoryBatch.group("m", ["y"], [1], [1], [2], [-1.0], [0], [1])
    with pytest.raises(ValueError, match="the batches carry different columns"):
        TrajectoryBatch.join([plain, masked])


def _bad_messages():
    key, t, meta = two_groups().encode()
    short = t["versions"][:5]
    return key, [
        # (meta, tensors, what the error names)
        ({"group_id": "g0", "sample_ids": ["a", "b", "c"]}, t, "trajectory_meta: unknown field 'group_id'"),
        ({k: v for k, v in meta.items() if k != "lengths"}, t, "trajectory_meta: missing field 'lengths'"),
        ({**meta, "group_sizes": [3]}, t, "2 group ids, 1 group sizes, 2 prompt lengths: expected one size and one"),
        ({**meta, "prompt_lengths": [4]}, t, "2 group ids, 2 group sizes, 1 prompt lengths"),
        ({**meta, "group_sizes": [4, -1]}, t, "group_sizes has a negative entry -1"),
        ({**meta, "prompt_lengths": [5, -1]}, t, "prompt_lengths has a negative entry -1"),
        ({**meta, "lengths": [2, 1]}, t, "3 sample ids but 2 lengths: expected one length a sample"),
        ({**meta, "sample_ids": ["a", "b"], "lengths": [2, 1]}, t, "group sizes \\[2, 1\\] sum to 3, not to the 2"),
        ({**meta, "sample_ids": ["a", "b", 3]}, t, "trajectory_meta.sample_ids: expected list\\[str\\]"),
        ("not a map", t, "body is str"),
        (meta, {k: v for k, v in t.items() if k != "versions"}, "tensors \\[.*\\]; expected \\[.*'versions'\\]"),
        (meta, {**t, "extra": torch.zeros(1)}, "expected .* and optionally \\['entropy', 'loss_mask', 'score'\\]"),
        (meta, {**t, "output_ids": t["output_ids"].long()}, "output_ids is torch.int64 of shape \\(6,\\)"),
        (meta, {**t, "logprobs": t["logprobs"].view(2, 3)}, "logprobs is torch.float32 of shape \\(2, 3\\)"),
        ({**meta, "prompt_lengths": [2, 1]}, t, "prompt_ids has 4 entries; expected 3 \\(the prompt lengths' sum\\)"),
        ({**meta, "lengths": [2, 2, 3]}, t, "output_ids has 6 entries; expected 7 \\(the output lengths' sum\\)"),
        (meta, {**t, "versions": short}, "versions has 5 entries; expected 6 \\(the output lengths' sum\\)"),
        (meta, {**t, "loss_mask": torch.ones(4, dtype=torch.bool)}, "loss_mask has 4 entries; expected 6"),
    ]


def test_every_malformed_message_is_refused_naming_what_is_wrong():
    key, bad = _bad_messages()
    for meta, tensors, match in bad:
        with pytest.raises(ProtocolError, match="^trajectory message 'g0': .*" + match):
            TrajectoryBatch.decode(key, meta, tensors)


def test_a_sender_cannot_encode_an_inconsistent_batch():
    batch = two_groups()
    batch.lengths = [2, 1, 2]
    with pytest.raises(ProtocolError, match="output_ids has 6 entries; expected 5"):
        batch.encode()
    batch.lengths = [2, 1]
    with pytest.raises(ProtocolError, match="3 sample ids but 2 lengths"):
        batch.encode()


def test_bad_and_short_frames_over_a_real_channel_are_logged_and_the_buffer_goes_on(tmp_path, caplog):
    """Over real zmq sockets: a frame shorter than its header says, a message of the old one-group layout and
    one whose versions are short are each refused with the reason in the log; the good message after them
    is buffered as its views."""
    rx = make_tensor_channel("zmq", role="receiver", endpoint=ipc_endpoint(tmp_path, "traj"))
    tx = make_tensor_channel("zmq", role="sender", endpoint=rx.endpoint)
    buf = TrajectoryBuffer(rx)
    buf.thread.start()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(rx.endpoint)
    try:
        key, t, meta = two_groups().encode()
        frames = encode_tensors(key, meta, t)
        raw.send_multipart(frames[:-1] + [bytes(frames[-1])[:-4]])  # the last tensor's frame cut short
        tx.send(key, t, {"group_id": "g0", "sample_ids": ["a", "b", "c"]})
        tx.send(key, {**t, "versions": t["versions"][:5]}, meta)
        tx.send("g2", *TrajectoryBatch.group("g2", ["d"], [1], [1], [2], [-1.0], [0]).encode()[1:])
        deadline = time.monotonic() + 10
        # the raw socket is another connection: its refusal may be logged after "d" is buffered
        while "d" not in buf.items or sum(r.levelno >= logging.ERROR for r in caplog.records) < 3:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.01)
    finally:
        buf.stopping.set()
        buf.thread.join(5)
        raw.close(0)
        tx.close()
        rx.close()
    assert list(buf.items) == ["d"] and isinstance(buf.items["d"], Trajectory)
    errors = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert errors == [  # the raw socket is another connection: its frame may come before or after the others
        "refused: trajectory message 'g0': trajectory_meta: unknown field 'group_id'",
        "refused: trajectory message 'g0': versions has 5 entries; expected 6 (the output lengths' sum)",
        "trajectory frame refused: tensor 'versions': int32[6] needs 24 bytes; header says 24, payload has 20",
    ]
