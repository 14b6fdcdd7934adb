"""Data-parallel batches without a process group: the split over ranks by tokens and the batch's trip between
ranks as the trajectory type's own encode in one uint8 buffer (the ranks themselves, spawned on gloo:
tests/contract/test_trainer_dp.py)."""

import pytest
import torch

from protocols.messages import ProtocolError

from areal_async.trainer.dp import (
    decode_batch,
    encode_batch,
    minibatches_by_tokens,
    rank_micro_batches,
    split_over_ranks,
)
from tests.support.trainer_fixtures import make_trajs


def test_split_over_ranks_balances_tokens_and_keeps_every_index():
    lengths = [23, 6, 13, 6, 16, 7, 10]
    shares = split_over_ranks(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(7))
    sums = [sum(lengths[i] for i in s) for s in shares]
    # total 81: largest differencing gives 42 / 39 (by hand: 23+6+6+7 vs 16+13+10); the best is 41 / 40
    assert sums == [42, 39]
    assert split_over_ranks(lengths, 2) == shares  # deterministic: every rank computes the same
    assert split_over_ranks([5], 3) == [[0], [], []]
    per_rank, n = rank_micro_batches(lengths, shares, 24, "error")
    assert n == max(len(m) for m in per_rank) and all(sum(lengths[i] for i in mb) <= 24 for m in per_rank for mb in m)
    mbs = minibatches_by_tokens(lengths, 2)
    assert sorted(i for m in mbs for i in m) == list(range(7)) and all(mbs)


def test_batch_crosses_ranks_as_the_trajectory_type_encode_and_back():
    trajs = make_trajs()
    buf = encode_batch(trajs)
    back = decode_batch(buf)

    def as_lists(ts):
        return [(t.sample_id, t.group_id, t.prompt_ids.tolist(), t.output_ids.tolist(), t.versions.tolist(), t.score)
                for t in ts]  # fmt: skip

    assert as_lists(back) == as_lists(trajs)  # sample and group ids kept (the old format renamed them b0, g0)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(back, trajs))
    assert {(a.output_ids.dtype, a.versions.dtype) for a in back} == {(torch.int32, torch.int32)}
    assert back[0].output_ids.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # views of buf


def test_a_damaged_rank_batch_is_refused_naming_what_is_wrong():
    buf = encode_batch(make_trajs())
    with pytest.raises(ProtocolError, match="rank batch: torch.uint8\\[4\\] with header length"):
        decode_batch(buf[:4].clone())
    short = buf[:-200].clone()  # the last columns cut off
    with pytest.raises(ProtocolError, match="outside the"):
        decode_batch(short)
