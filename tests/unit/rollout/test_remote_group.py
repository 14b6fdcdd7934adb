"""The remote engine's finished group is the one trajectory type made from the servers' JSON lists, each
column once, end to end (no tensor a sample): its columns against the lists typed out by hand."""

from __future__ import annotations

import numpy as np
import torch

from areal_async.rollout.clients.remote import _Sample, group_batch
from areal_async.rollout.engines.engine import GenRequest


def test_a_remote_group_is_its_samples_json_lists_end_to_end_by_hand():
    req = GenRequest("q", [7, 8, 9], n=3, max_new_tokens=4)
    # sample 0 answered twice (resubmitted after an abort: versions 0 then 1); sample 2 never finished
    s0 = _Sample(None, 0, [11, 12, 13], [-0.5, -0.75, -1.0], [0, 1, 1], reason="length")
    s1 = _Sample(None, 1, [21], [-2.5], [1], reason="stop")
    batch = group_batch(req, [s0, s1, None])
    assert batch.sample_ids == ["q/0", "q/1", "q/2"] and batch.lengths == [3, 1, 0]
    assert batch.finish_reasons == ["length", "stop", "abort"]
    assert batch.prompt_ids.dtype == torch.int32 and batch.prompt_ids.tolist() == [7, 8, 9]
    assert batch.output_ids.dtype == torch.int32 and batch.output_ids.tolist() == [11, 12, 13, 21]
    assert batch.logprobs.dtype == torch.float32 and batch.logprobs.tolist() == [-0.5, -0.75, -1.0, -2.5]
    assert batch.versions.dtype == torch.int32 and batch.versions.tolist() == [0, 1, 1, 1]
    assert [r.output_ids.tolist() for r in batch.samples()] == [[11, 12, 13], [21], []]


def test_json_floats_round_to_float32_as_one_per_sample_conversion_did():
    """0.1 is not a float32: the column holds each JSON float rounded to float32 (numpy's rounding)."""
    req = GenRequest("r", [1], n=2, max_new_tokens=2)
    a, b = _Sample(None, 0, [5], [-0.1], [3], reason="stop"), _Sample(None, 1, [6, 7], [-1 / 3, -2.2], [3, 4], "stop")
    got = group_batch(req, [a, b]).logprobs
    want = np.array([-0.1, -1 / 3, -2.2], dtype=np.float32)
    assert got.dtype == torch.float32 and got.numpy().tobytes() == want.tobytes()
