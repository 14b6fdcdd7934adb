"""The one trajectory type (``protocols.trajectories``): its columns are the fields of ``Trajectory`` declared
with ``column``; a batch's encode is the wire form (bytes written out by hand here), its rows are views of
its tensors, the rank broadcast is the same encode in one buffer, and bad input is refused by name."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from protocols.messages import ProtocolError
from protocols.trajectories import COLUMNS, OPTIONAL, TOKEN_COLUMNS, Trajectory, TrajectoryBatch

from areal_async.trainer.compute.dp import decode_batch, encode_batch


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_columns_are_the_row_fields_declared_with_column_one_dtype_each():
    assert COLUMNS == {
        "prompt_ids": torch.int32,
        "output_ids": torch.int32,
        "logprobs": torch.float32,
        "versions": torch.int32,
        "score": torch.float64,
        "loss_mask": torch.bool,
        "entropy": torch.float32,
    }
    assert TOKEN_COLUMNS == ("output_ids", "logprobs", "versions", "loss_mask", "entropy")
    assert OPTIONAL == {"score", "loss_mask", "entropy"}


def test_rows_encode_to_bytes_written_by_hand_and_decode_to_the_same_rows():
    a = Trajectory("a", "g", [1, 2], [5, 6], [-0.5, -1.0], [3, 3], 1.0, loss_mask=[True, False])
    b = Trajectory("b", "g", a.prompt_ids, [7], [-2.0], [4], 0.0)  # no mask: filled in as all trained
    key, t, meta = TrajectoryBatch.of_samples([a, b]).encode()
    assert key == "g" and meta == {
        "group_ids": ["g"],
        "group_sizes": [2],
        "prompt_lengths": [2],
        "sample_ids": ["a", "b"],
        "lengths": [2, 1],
    }
    assert list(t) == ["prompt_ids", "output_ids", "logprobs", "versions", "score", "loss_mask"]
    assert _bytes(t["prompt_ids"]) == struct.pack("<2i", 1, 2)
    assert _bytes(t["output_ids"]) == struct.pack("<3i", 5, 6, 7)
    assert _bytes(t["logprobs"]) == struct.pack("<3f", -0.5, -1.0, -2.0)
    assert _bytes(t["versions"]) == struct.pack("<3i", 3, 3, 4)
    assert _bytes(t["score"]) == struct.pack("<2d", 1.0, 0.0)
    assert _bytes(t["loss_mask"]) == bytes([1, 0, 1])
    ra, rb = TrajectoryBatch.decode(key, meta, t).samples()
    assert (ra.sample_id, ra.group_id, ra.score, ra.loss_mask.tolist()) == ("a", "g", 1.0, [True, False])
    assert (rb.sample_id, rb.output_ids.tolist(), rb.logprobs.tolist(), rb.score) == ("b", [7], [-2.0], 0.0)
    assert {r.output_ids.dtype for r in (ra, rb)} == {torch.int32}


def test_rows_are_views_of_the_batch_tensors_not_copies():
    batch = TrajectoryBatch.group("g", ["a", "b"], [1, 2, 3], [2, 3], [5, 6, 7, 8, 9], [0.0] * 5, [1] * 5, [1] * 5)
    a, b = batch.samples()
    out = batch.output_ids
    assert a.prompt_ids.data_ptr() == b.prompt_ids.data_ptr() == batch.prompt_ids.data_ptr()  # the prompt once
    assert a.output_ids.data_ptr() == out.data_ptr() and b.output_ids.data_ptr() == out.data_ptr() + 2 * 4
    assert b.logprobs.data_ptr() == batch.logprobs.data_ptr() + 2 * 4
    assert b.loss_mask.data_ptr() == batch.loss_mask.data_ptr() + 2  # one byte a bool
    b.output_ids[0] = 70  # the same memory
    assert out.tolist() == [5, 6, 70, 8, 9]
    one = TrajectoryBatch.of_samples([a])  # one row: its tensors as they are
    assert one.output_ids.data_ptr() == a.output_ids.data_ptr()


def test_the_rank_broadcast_is_the_same_encode_with_sample_ids_and_rows_are_views_of_its_buffer():
    rows = [
        Trajectory("s0", "g0", [1], [2, 3], [-1.0, -2.0], [5, 5], 0.5, segment_starts=[1]),
        Trajectory("s1", "g1", [4], [5], [-3.0], [6], 1.0),
    ]
    buf = encode_batch(rows)
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    back = decode_batch(buf)
    assert [(r.sample_id, r.group_id, r.score, r.segment_starts) for r in back] == [
        ("s0", "g0", 0.5, [1]),
        ("s1", "g1", 1.0, None),
    ]
    base, start = buf.data_ptr(), (8 + n + 63) // 64 * 64  # the payload starts 64-byte aligned after the header
    # columns in order, each 64-byte aligned: prompt_ids (8 B) at 0, output_ids at 64, logprobs at 128, ...
    assert back[0].prompt_ids.data_ptr() == base + start and back[1].prompt_ids.data_ptr() == base + start + 4
    assert back[1].output_ids.data_ptr() == base + start + 64 + 2 * 4
    assert back[1].logprobs.data_ptr() == base + start + 128 + 2 * 4


def test_bad_rows_and_batches_are_refused_by_name():
    ok = Trajectory("a", "g", [1], [2], [-1.0], [0], 1.0)
    with pytest.raises(ValueError, match="trajectory 'x': len\\(loss_mask\\)=2, expected len\\(output_ids\\)=1"):
        Trajectory("x", "g", [1], [2], [-1.0], [0], loss_mask=[True, True])
    with pytest.raises(ValueError, match="trajectory 'x': loss_mask trains no token"):
        Trajectory("x", "g", [1], [2], [-1.0], [0], loss_mask=[False])
    with pytest.raises(ValueError, match="unknown columns \\['entropies'\\]"):
        TrajectoryBatch.group("g", ["a"], [1], [1], [2], [-1.0], [0], entropies=[0.5])
    with pytest.raises(ValueError, match="of_samples got no rows"):
        TrajectoryBatch.of_samples([])
    key, t, meta = TrajectoryBatch.of_samples([ok]).encode()
    with pytest.raises(ProtocolError, match="loss_mask is torch.int8 of shape \\(1,\\); expected a 1D torch.bool"):
        TrajectoryBatch.decode(key, meta, {**t, "loss_mask": torch.ones(1, dtype=torch.int8)})
    with pytest.raises(ProtocolError, match="score has 2 entries; expected 1 \\(one a sample\\)"):
        TrajectoryBatch.decode(key, meta, {**t, "score": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(ValueError, match="empty output_ids"):  # a received row is checked when a step takes it
        TrajectoryBatch.group("g", ["e"], [1], [0], [], [], []).samples()[0].scored(1.0)


def test_an_unscored_batch_has_no_score_column_and_its_rows_read_nan():
    batch = TrajectoryBatch.of_samples([Trajectory("a", "g", [1], [2], [-1.0], [0])])
    assert "score" not in batch.tensors() and math.isnan(batch.samples()[0].score)
