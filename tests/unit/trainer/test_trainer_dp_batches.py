"""Data-parallel batches without a process group: the split over ranks by tokens and the batch's trip between
ranks as three tensors (the ranks themselves, spawned on gloo: tests/contract/test_trainer_dp.py)."""

import math
import os

import torch

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


def test_batch_crosses_ranks_as_three_tensors_and_back():
    trajs = make_trajs()
    back = decode_batch(*encode_batch(trajs))

    def as_lists(ts):
        return [(t.prompt_ids.tolist(), t.output_ids.tolist(), t.versions.tolist(), t.score) for t in ts]

    assert as_lists(back) == as_lists(trajs)
    assert all(
        torch.equal(torch.as_tensor(a.behav_logp), torch.as_tensor(b.behav_logp, dtype=torch.float32))
        for a, b in zip(back, trajs)
    )
    # group structure kept (names are not)
    same = lambda ts: [[a.group_id == b.group_id for b in ts] for a in ts]  # noqa: E731
    assert same(back) == same(trajs)
    assert not math.isnan(sum(x for t in back for x in t.behav_logp)) and os.getpid()
