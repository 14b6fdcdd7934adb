"""The recording format (trainer/persist/recording.py): round trip, and a bad file gives a clear error naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from areal_async.trainer.persist.recording import (
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
from protocols.trajectories import Trajectory


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


def test_round_trip_keeps_every_field_and_the_order(tmp_path):
    (tmp_path / "recording").mkdir()
    rng = torch.get_rng_state()
    n = write_step(tmp_path, 7, 8, batch(), rng)
    assert n == step_path(tmp_path, 7).stat().st_size
    rec = read_step(step_path(tmp_path, 7))
    assert (rec.step, rec.version) == (7, 8)
    assert torch.equal(rec.rng_state, rng)
    for got, want in zip(rec.trajs, batch(), strict=True):
        assert (got.sample_id, got.group_id, got.score) == (want.sample_id, want.group_id, want.score)
        for f in ("prompt_ids", "output_ids", "logprobs", "versions"):
            assert torch.equal(getattr(got, f), getattr(want, f).to(getattr(got, f).dtype)), f
        assert torch.equal(got.loss_mask, torch.ones_like(got.loss_mask) if want.loss_mask is None else want.loss_mask)
    assert recorded_steps(tmp_path) == [7]


def test_the_wire_layout_prompt_once_a_group_and_its_dtypes():
    """Groups of consecutive samples with one prompt: g0's prompt (3 tokens) once, g1's (1 token) once; a sample of
    g0 coming after g1 is a group of its own. Per output token: int32 id + float32 logprob + int32 version + bool
    mask = 13 bytes."""
    trajs = [*batch(), Trajectory("r0-s3", "g0", [5, 6, 7], [11], [-1.0], [4], 1.0)]
    t, meta = encode_step(0, 1, trajs, torch.get_rng_state())
    layout = json.loads(meta["trajectory_meta"])
    assert (layout["group_ids"], layout["group_sizes"], layout["prompt_lengths"]) == (
        ["g0", "g1", "g0"], [2, 1, 1], [3, 1, 3]
    )  # fmt: skip
    assert t["prompt_ids"].tolist() == [5, 6, 7, 1, 5, 6, 7]
    assert {k: t[k].dtype for k in ("prompt_ids", "output_ids", "logprobs", "versions", "loss_mask")} == {
        "prompt_ids": torch.int32, "output_ids": torch.int32, "logprobs": torch.float32,
        "versions": torch.int32, "loss_mask": torch.bool,
    }  # fmt: skip
    per_token = sum(t[k].numel() * t[k].element_size() for k in ("output_ids", "logprobs", "versions", "loss_mask"))
    assert per_token == 7 * 13


def test_same_group_different_prompts_are_two_groups():
    a = Trajectory("a", "g", [1, 2], [3], [-1.0], [0], 0.0)
    b = Trajectory("b", "g", [1, 9], [3], [-1.0], [0], 1.0)
    _, meta = encode_step(0, 1, [a, b], torch.get_rng_state())
    assert json.loads(meta["trajectory_meta"])["group_sizes"] == [1, 1]


def test_unmasked_batch_has_no_mask_tensor():
    trajs = [batch()[0]]
    t, _ = encode_step(0, 1, trajs, torch.get_rng_state())
    assert "loss_mask" not in t


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
    cases = [
        ({}, {"format": "something-else/9"}, "format 'something-else/9'"),
        ({"logprobs": t["logprobs"][:-1].clone()}, {}, "logprobs has 5 entries; expected 6"),
        (
            {"logprobs": t["logprobs"].double()},
            {},
            "logprobs is torch.float64 of shape (6,); expected a 1D torch.float32",
        ),
        ({"score": t["score"][:2].clone()}, {}, "score has 2 entries; expected 3 (one a sample)"),
        ({}, {"trajectory_meta": "[1, 2"}, "not a well-formed recorded step (JSONDecodeError"),
    ]
    for i, (tensors, metadata, fragment) in enumerate(cases):
        path = tmp_path / f"{i}.safetensors"
        save_file({**t, **tensors}, str(path), metadata={**meta, **metadata})
        with pytest.raises(RecordingError, match=re.escape(f"{path}: ") + ".*" + re.escape(fragment)):
            read_step(path)


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
