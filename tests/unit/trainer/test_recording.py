"""The recording format (trainer/recording.py): round trip, and a bad file gives a clear error naming it."""

from __future__ import annotations

import json

import pytest
import torch

from areal_async.trainer.recording import (
    Recorder,
    RecordingError,
    encode_step,
    machine_header,
    read_header,
    read_step,
    recorded_steps,
    step_path,
    write_step,
)
from areal_async.trainer.types import Trajectory


def batch() -> list[Trajectory]:
    """Three trajectories: int32 wire tensors, one int64 prompt, one with a loss mask, a fractional score."""
    return [
        Trajectory(
            "r0-s0",
            "g0",
            torch.tensor([5, 6, 7], dtype=torch.int32),
            torch.tensor([8, 9], dtype=torch.int32),
            torch.tensor([-0.5, -1.25]),
            torch.tensor([3, 4], dtype=torch.int32),
            1.0,
        ),
        Trajectory(
            "r0-s1",
            "g0",
            torch.tensor([5, 6, 7], dtype=torch.int32),
            torch.tensor([10], dtype=torch.int32),
            torch.tensor([-2.0]),
            torch.tensor([4], dtype=torch.int32),
            0.0,
            loss_mask=torch.tensor([True]),
        ),
        Trajectory(
            "r0-s2",
            "g1",
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([2, 3, 4], dtype=torch.int32),
            torch.tensor([-0.1, -0.2, -0.3]),
            torch.tensor([2, 2, 3], dtype=torch.int32),
            0.375,
            loss_mask=torch.tensor([True, False, True]),
        ),
    ]


def test_round_trip_keeps_every_field_order_and_dtype(tmp_path):
    (tmp_path / "recording").mkdir()
    rng = torch.get_rng_state()
    n = write_step(tmp_path, 7, 8, batch(), rng)
    assert n == step_path(tmp_path, 7).stat().st_size
    rec = read_step(step_path(tmp_path, 7))
    assert (rec.step, rec.version) == (7, 8)
    assert torch.equal(rec.rng_state, rng)
    for got, want in zip(rec.trajs, batch(), strict=True):
        assert (got.sample_id, got.group_id, got.score) == (want.sample_id, want.group_id, want.score)
        for f in ("prompt_ids", "output_ids", "behav_logp", "versions"):
            assert getattr(got, f).dtype == getattr(want, f).dtype, f
            assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert (got.loss_mask is None) == (want.loss_mask is None)
        if want.loss_mask is not None:
            assert torch.equal(got.loss_mask, want.loss_mask)
    assert recorded_steps(tmp_path) == [7]


def test_layout_is_compact(tmp_path):
    """Per output token: int32 id + float32 logprob + int32 version + uint8 mask = 13 bytes; per prompt token 4."""
    t, _ = encode_step(0, 1, batch(), torch.get_rng_state())
    per_token = sum(t[k].numel() * t[k].element_size() for k in ("output_ids", "behav_logp", "versions", "loss_mask"))
    assert per_token == 6 * 13
    assert t["prompt_ids"].numel() * t["prompt_ids"].element_size() == 7 * 4


def test_unmasked_batch_has_no_mask_tensor():
    trajs = [batch()[0]]
    t, _ = encode_step(0, 1, trajs, torch.get_rng_state())
    assert "loss_mask" not in t and "has_mask" not in t


def test_truncated_file_is_a_clear_error(tmp_path):
    (tmp_path / "recording").mkdir()
    write_step(tmp_path, 0, 1, batch(), torch.get_rng_state())
    p = step_path(tmp_path, 0)
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(RecordingError, match=r"step_000000\.safetensors: unreadable safetensors file"):
        read_step(p)


def test_not_safetensors_and_missing_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_text("hello")
    with pytest.raises(RecordingError, match="unreadable safetensors"):
        read_step(p)
    with pytest.raises(RecordingError, match="no such recorded step"):
        read_step(tmp_path / "none.safetensors")


def test_other_format_and_inconsistent_lengths_are_refused(tmp_path):
    from safetensors.torch import save_file

    t, meta = encode_step(3, 4, batch(), torch.get_rng_state())
    save_file(t, str(tmp_path / "a.safetensors"), metadata={**meta, "format": "something-else/9"})
    with pytest.raises(RecordingError, match="format 'something-else/9'"):
        read_step(tmp_path / "a.safetensors")
    bad = dict(t, behav_logp=t["behav_logp"][:-1].clone())
    save_file(bad, str(tmp_path / "b.safetensors"), metadata=meta)
    with pytest.raises(RecordingError, match="behav_logp has 5 entries; the lengths add up to 6"):
        read_step(tmp_path / "b.safetensors")
    save_file(t, str(tmp_path / "c.safetensors"), metadata={**meta, "sample_ids": json.dumps(["a", "b"])})
    with pytest.raises(RecordingError, match="2 sample ids, 3 group ids"):
        read_step(tmp_path / "c.safetensors")
    wrong = dict(t, behav_logp=t["behav_logp"].double())
    save_file(wrong, str(tmp_path / "d.safetensors"), metadata=meta)
    with pytest.raises(RecordingError, match="behav_logp is torch.float64; expected float32"):
        read_step(tmp_path / "d.safetensors")


def test_recorder_rolls_back_steps_a_resumed_trainer_trains_again(tmp_path):
    header = machine_header("cpu", 1, "float32")
    rec = Recorder(tmp_path, 0, header)
    for s in range(5):
        rec.step(s, s + 1, batch(), torch.get_rng_state())
    assert recorded_steps(tmp_path) == [0, 1, 2, 3, 4]
    Recorder(tmp_path, 3, header)  # resumed from the checkpoint after step 2
    assert recorded_steps(tmp_path) == [0, 1, 2]
    assert read_header(tmp_path)["torch_threads"] == torch.get_num_threads()


def test_header_missing_or_foreign(tmp_path):
    with pytest.raises(RecordingError, match="no recording header; expected a run with rollout.dump_tensors=true"):
        read_header(tmp_path)
    (tmp_path / "recording").mkdir()
    (tmp_path / "recording" / "header.json").write_text('{"format": "v0"}')
    with pytest.raises(RecordingError, match="format 'v0'"):
        read_header(tmp_path)
