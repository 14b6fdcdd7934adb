"""The rollout-only trainer's stand-in (trainer/frozen.py): fixed weights, then a schedule from checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from areal_async.trainer.frozen import FrozenActor, weight_schedule
from protocols.trajectories import Trajectory


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _checkpoint(root: Path, step: int, version: int, seed: int) -> Path:
    d = root / "checkpoints" / f"step_{step}"
    _model(seed).save_pretrained(d)
    (d / "meta.json").write_text(json.dumps({"step": step, "version": version}))
    (d / "COMPLETE").write_text("ok\n")
    return d


def test_frozen_actor_publishes_fixed_then_scheduled_weights(tmp_path):
    c2, c5 = _checkpoint(tmp_path, 1, 2, seed=1), _checkpoint(tmp_path, 4, 5, seed=2)
    (tmp_path / "checkpoints" / "step_9").mkdir()  # no COMPLETE: not in the schedule
    assert weight_schedule(tmp_path) == [(2, c2), (5, c5)]
    v0 = {k: v.clone() for k, v in _model(0).state_dict().items()}
    actor = FrozenActor(_model(0), weight_schedule(tmp_path))
    trajs = [
        Trajectory("a", "g", [1], [2, 3, 4], [-1.0] * 3, [0] * 3, 1.0),
        Trajectory("b", "g", [1], [5], [-1.0], [0], 0.0),
    ]
    want = {1: v0, 2: _model(1).state_dict(), 3: _model(1).state_dict(), 5: _model(2).state_dict()}
    for version in range(1, 6):
        m = actor.train_step(trajs)
        assert (m["n_seqs"], m["n_tokens"], m["score_mean"], m["optimizer_steps"]) == (2, 4, 0.5, 0)
        got = actor.publish_state(torch.bfloat16, 1 << 20)
        if version in want:
            assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want[version].items()), version
    assert actor.source(1) is None and actor.source(4) == c2


def test_weight_schedule_without_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint under"):
        weight_schedule(tmp_path)
