"""Every RL run keeps its trained policy: RUN_DIR/model, an HF directory with the tokenizer and its chat
template, written after the last step (trainer/persist/final_model.py). Checked against sources written apart from
it: the checkpoint of the same version (the checkpointer's export), the one of an earlier version, and the
in-run evaluation of the last version (the trainer's evaluator on its in-memory weights), which
``areal-async eval --model RUN_DIR/model`` must reproduce from disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.fleet import ROOT, read_jsonl, run_ok

pytestmark = pytest.mark.slow


def test_an_rl_run_ends_with_its_final_policy_that_eval_and_transformers_load(tmp_path):
    run = tmp_path / "run"
    evaluator = ["evaluator.greedy=true", "evaluator.n_samples=1", "evaluator.max_problems=12"]
    # length_parity: mixed scores from a barely warmed-up policy, so every step has a gradient (with the
    # default reward a 10-step warm-up can score 0 everywhere, and the weights never move)
    parity = "reward.fn=tests.support.reward_fixtures:length_parity"
    run_ok(run, "total_train_steps=4", "saver.freq_steps=2", "evaluator.freq_steps=4", parity, *evaluator)
    final = load_file(run / "model" / "model.safetensors")
    same_version = load_file(run / "checkpoints" / "step_3" / "model.safetensors")  # version 4, the last
    earlier = load_file(run / "checkpoints" / "step_1" / "model.safetensors")  # version 2
    assert final.keys() == same_version.keys() and all(final[k].equal(same_version[k]) for k in final)
    assert any(not final[k].equal(earlier[k]) for k in final)  # it is the trained policy, not an early one
    model = AutoModelForCausalLM.from_pretrained(run / "model", local_files_only=True)
    assert all(model.state_dict()[k].equal(v) for k, v in final.items())
    tok = AutoTokenizer.from_pretrained(run / "model", local_files_only=True)
    assert tok.chat_template and tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False)
    last = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "eval" and r["version"] == 4]
    out = tmp_path / "ev"
    cmd = [sys.executable, "-m", "areal_async.cli", "eval", str(run / "config.yaml"), "--model", str(run / "model")]
    done = subprocess.run([*cmd, "--out", str(out), *evaluator], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "eval_summary.json").read_text())
    assert len(last) == 1 and summary["n_problems"] == last[0]["eval_n_problems"] == 12
    assert summary["pass1"] == last[0]["eval_pass1"] and summary["ci_low"] == last[0]["eval_pass1_ci_low"]
