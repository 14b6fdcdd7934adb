"""The trainer's batch takes the one trajectory type's columns: hand-built rows against the batch's arrays
(values typed out by hand, dtypes as ``protocols/trajectories.py`` declares them), a view of the message
when its rows lie end to end there, one copy when not."""

from __future__ import annotations

import math

import torch

from protocols.trajectories import Trajectory, TrajectoryBatch

from areal_async.trainer.actor import _Batch

CPU = torch.device("cpu")


def _rows() -> list[Trajectory]:
    a = Trajectory("a", "g", [1, 2], [3, 4], [-0.5, -1.5], [0, 1], 1.0)
    b = Trajectory("b", "g", [1, 2], [5, 6, 7], [-2.0, -0.25, -4.0], [1, 1, 1], 0.0, loss_mask=[True, False, True])
    c = Trajectory("c", "h", [8], [9], [-3.0], [2], 1.0)
    return [a, b, c]


def test_the_batch_is_the_rows_columns_end_to_end_by_hand():
    batch = _Batch(_rows(), CPU)
    assert batch.behav.dtype == torch.float32 and batch.behav.tolist() == [-0.5, -1.5, -2.0, -0.25, -4.0, -3.0]
    assert batch.mask.dtype == torch.bool  # a and c have no mask: every token trained
    assert batch.mask.tolist() == [True, True, True, False, True, True]
    assert batch.versions.dtype == torch.int32 and batch.versions.tolist() == [0, 1, 1, 1, 1, 2]
    assert batch.n_out == [2, 3, 1] and batch.n_prompt == [2, 2, 1] and batch.lengths == [4, 5, 2]
    assert batch.out_start.tolist() == [0, 2, 5] and batch.entropy is None


def test_rows_of_one_message_in_order_are_a_view_and_reordered_ones_a_copy():
    key, tensors, meta = TrajectoryBatch.of_samples(_rows()).encode()
    rows = [r.scored(r.score) for r in TrajectoryBatch.decode(key, meta, tensors).samples()]
    logprobs = tensors["logprobs"]
    view = _Batch(rows, CPU)  # the rows lie end to end in the message's columns: no copy
    assert view.behav.data_ptr() == logprobs.data_ptr() and view.versions.data_ptr() == tensors["versions"].data_ptr()
    assert view.behav.tolist() == [-0.5, -1.5, -2.0, -0.25, -4.0, -3.0]
    copy = _Batch([rows[2], rows[0], rows[1]], CPU)  # another order: one copy, in that order
    assert copy.behav.data_ptr() != logprobs.data_ptr()
    assert copy.behav.tolist() == [-3.0, -0.5, -1.5, -2.0, -0.25, -4.0]
    assert copy.mask.tolist() == [True, True, True, True, False, True]
    gap = _Batch([rows[0], rows[2]], CPU)  # one message's rows with a row left out between them: a copy
    assert gap.behav.data_ptr() != logprobs.data_ptr() and gap.behav.tolist() == [-0.5, -1.5, -3.0]


def test_the_engines_entropy_column_fills_nan_for_a_row_without_it():
    a = Trajectory("a", "g", [1], [2, 3], [-1.0, -1.0], [0, 0], 1.0, entropy=[0.5, 1.5])
    c = Trajectory("c", "h", [1], [7], [-1.0], [0], 0.0)
    ent = _Batch([a, c], CPU).entropy
    assert ent.dtype == torch.float32 and ent[:2].tolist() == [0.5, 1.5] and math.isnan(ent[2].item())
