"""One role at a time and the recording: the ``mode`` and ``solo.*`` keys (config checks, preflight) and the
recording's size estimate (supervisor/preflight_solo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_async import cli
from areal_async.config import ConfigError, load_config
from areal_async.supervisor.preflight import context_for
from areal_async.supervisor.preflight_solo import check_recording, check_solo, step_bytes_bound
from areal_async.trainer.persist.recording import Recorder, machine_header
from protocols.trajectories import Trajectory

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/tiny_arith.yaml")


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["mode=solo"], "mode='solo': expected fleet | rollout_only | train_only"),
        (["mode=train_only"], "solo.recording='': expected a run directory"),
        (["mode=rollout_only", "cluster.n_trainer_ranks=2"], "one role at a time runs one trainer process"),
        (["mode=train_only", "solo.recording=x", "model.dtype=bfloat16"], "train_only runs one unsharded float32"),
    ],
)
def test_mode_config_errors(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, overrides)


def test_step_bytes_bound_by_hand():
    # 2 groups x (4 x 3 prompt bytes + 60 + 4 samples x (12 x 5 output bytes + 68)) + 5056 RNG + 1024
    assert step_bytes_bound(2, 4, 3, 5, with_mask=False) == 2 * (12 + 60 + 4 * (60 + 68)) + 5056 + 1024
    assert step_bytes_bound(2, 4, 3, 5, with_mask=True) == 2 * (12 + 60 + 4 * (65 + 68)) + 5056 + 1024


def test_recording_estimate_is_printed_with_the_run(tmp_path):
    cfg = load_config(TINY, ["rollout.dump_tensors=true", "total_train_steps=10"])
    (f,) = check_recording(context_for(cfg, TINY, ["rollout.dump_tensors=true"], "run", tmp_path / "r"))
    assert f.level == "ok"
    # 32 x 4 sequences; no tokenizer in this context: prompts at the bound, 64 positions - 12 new tokens = 52
    per = 32 * (4 * 52 + 60 + 4 * (12 * 12 + 68)) + 5056 + 1024
    assert f"about {per / 1024:.1f} KiB per step (128 sequences of 52 prompt + <= 12 new tokens)" in f.line
    assert f"{per * 10 / 1024:.1f} KiB for 10 steps" in f.line


def _refusal(capsys, *args: str) -> str:
    assert cli.main(["run", TINY, "--run-dir", "/tmp/never-made", *args]) == 2
    return capsys.readouterr().err.strip()


def test_preflight_refuses_solo_keys_the_mode_does_not_read(capsys):
    line = _refusal(capsys, "solo.recording=/tmp/x")
    assert line.startswith("areal-async: solo.recording='/tmp/x': mode='fleet' trains no recording")
    line = _refusal(capsys, "mode=train_only", "solo.recording=/tmp/x", "rollout.dump_tensors=true")
    assert "rollout.dump_tensors=True: mode='train_only' trains a recording and records nothing" in line
    line = _refusal(capsys, "mode=rollout_only", "saver.freq_steps=5")
    assert "saver.freq_steps=5: mode='rollout_only': nothing learns, nothing is saved" in line


def test_preflight_checks_the_sources(tmp_path, capsys):
    line = _refusal(capsys, "mode=train_only", f"solo.recording={tmp_path}")
    assert f"no readable {tmp_path}/recording/header.json" in line
    Recorder(tmp_path, 0, machine_header("cpu", 1, "float32"))
    assert "header but no recorded step" in _refusal(capsys, "mode=train_only", f"solo.recording={tmp_path}")
    line = _refusal(capsys, "mode=rollout_only", f"solo.weights={tmp_path}")
    assert f"no complete checkpoint under {tmp_path}/checkpoints" in line


def test_check_solo_counts_recorded_steps(tmp_path):
    rec = Recorder(tmp_path, 0, machine_header("cpu", 1, "float32"))
    t = Trajectory("a", "g", [1], [2, 3], [-1.0, -1.0], [0, 0], 1.0)
    for s in (0, 1, 2):
        rec.step(s, s + 1, [t], torch.get_rng_state())
    cfg = load_config(TINY, ["mode=train_only", f"solo.recording={tmp_path}", "total_train_steps=2"])
    (f,) = check_solo(context_for(cfg, TINY, [], "run", tmp_path / "r"))
    assert (f.level, f.line.split(": ", 1)[1]) == ("ok", "3 recorded steps (0..2), 2 to train")
