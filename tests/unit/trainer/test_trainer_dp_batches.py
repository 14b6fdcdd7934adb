"""Data-parallel batches without a process group: the split over ranks by tokens and the batch's trip between
ranks as the trajectory type's own encode in one uint8 buffer (the ranks themselves, spawned on gloo:
tests/contract/test_trainer_dp.py)."""

import json

import pytest
import torch

from protocols.messages import ProtocolError

from areal_async.trainer.compute.dp import (
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


def test_the_rank_batch_header_is_json_checked_as_the_channels_header():
    """The header is JSON (trainer ranks on a bare GPU image have no msgpack) with the TensorHeader's checks."""
    buf = encode_batch(make_trajs())
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    head = json.loads(buf[8 : 8 + n].numpy().tobytes())
    assert set(head) == {"key", "meta", "specs"} and head["meta"]["sample_ids"] == [t.sample_id for t in make_trajs()]
    bad = buf.clone()
    bad[8] = ord("X")  # '{' -> 'X'
    with pytest.raises(ProtocolError, match="rank batch: its header is not JSON"):
        decode_batch(bad)
    head["specs"] = "columns"  # a field of the wrong type
    text = json.dumps(head).encode()
    forged = torch.cat([torch.tensor(list(len(text).to_bytes(8, "little")), dtype=torch.uint8),
                        torch.tensor(list(text), dtype=torch.uint8), buf[8 + n :]])  # fmt: skip
    with pytest.raises(ProtocolError, match="tensors.specs"):
        decode_batch(forged)
