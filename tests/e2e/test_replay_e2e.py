"""Record and replay on a real fleet (the CLI, real processes): a 6-step tiny run records every batch;
``areal-async replay --steps 2:6`` reproduces the run's checkpoint of version 6 bit for bit (exit 0, equal
SHA-256), a checkpoint nudged by one ulp in one tensor gives exit 1 naming that tensor, and
``mode=train_only`` trains the recording alone, writing the fleet's metrics columns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from areal_async.app.commands.replay import build_actor, state_digest, state_tensors
from areal_async.cli import main
from areal_async.config import load_config
from areal_async.trainer.persist.sharded_ckpt import save_shards
from tests.e2e.test_e2e import ROOT, read_jsonl, run_ok

pytestmark = pytest.mark.slow

# scores are mostly 0 after a 10-step warm-up: without reward and advantage normalisation they still move the weights
LEARNS = [
    "actor.reward_norm.mean_level=none",
    "actor.reward_norm.std_level=none",
    "actor.adv_norm.mean_level=none",
    "actor.adv_norm.std_level=none",
]
RECORD = ["rollout.dump_tensors=true", "saver.freq_steps=2", "saver.keep_last=10", *LEARNS]


def test_record_replay_bit_identical_then_corrupted_and_train_only(tmp_path, capsys):
    run = tmp_path / "run"
    run_ok(run, *RECORD)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "record_bytes" in r]
    files = sorted((run / "recording").glob("step_*.safetensors"))
    assert [r["record_bytes"] for r in rows] == [f.stat().st_size for f in files] and len(files) == 6

    out = subprocess.run(
        [sys.executable, "-m", "areal_async.cli", "replay", str(run), "--steps", "2:6"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    shas = [line.rsplit(" ", 1)[1] for line in out.stdout.splitlines() if "sha256" in line]
    assert len(shas) == 2 and shas[0] == shas[1]
    assert out.stdout.count("(the run's: same)") == 4  # each step's loss equals the fleet's, bit for bit
    cfg = load_config(run / "config.yaml")
    start = state_digest(state_tensors(build_actor(cfg, run / "checkpoints" / "step_1")))
    assert start != shas[1]  # steps 2..5 moved the weights: the identity is not trivial

    # the header keeps the trainer's linears as auto resolved them (a timing), and replay runs those: with the other
    # kernels written there, the same steps sum in other orders and differ
    header = json.loads((run / "recording" / "header.json").read_text())
    other = tmp_path / "other"
    shutil.copytree(run, other)
    flipped = {"onednn": "blas", "blas": "onednn"}[header["linears"]]
    (other / "recording" / "header.json").write_text(json.dumps(header | {"linears": flipped}))
    capsys.readouterr()
    assert main(["replay", str(other), "--steps", "4:6"]) == 1, capsys.readouterr()
    shutil.rmtree(other)

    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    end = bad / "checkpoints" / "step_5"
    actor = build_actor(cfg, end)
    with torch.no_grad():
        w = actor.model.get_parameter("model.norm.weight")
        w[5] = torch.nextafter(w[5], torch.tensor(float("-inf")))
    shutil.rmtree(end / "dcp")
    save_shards(end, actor.model, actor.optimizer)
    capsys.readouterr()
    assert main(["replay", str(bad), "--steps", "4:6"]) == 1
    assert "first tensor: model.norm.weight (1 of 128 elements differ in bits" in capsys.readouterr().err

    solo = tmp_path / "solo"
    assert main(["run", str(ROOT / "configs/tiny_arith.yaml"), "--run-dir", str(solo), "--no-progress",
                 "mode=train_only", f"solo.recording={run}", "sft_warmup.steps=10", *LEARNS]) == 0  # fmt: skip
    alone, fleet = read_jsonl(solo / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in alone] == list(range(6))
    timing = {"step", "version", "step_s", "wall_s", "plan_wait_s", "wait_data_s", "train_s", "publish_s"}
    assert timing <= set(alone[0]) and timing <= set(fleet[0])
    assert [r["samples_trained"] for r in alone] == [r["samples_trained"] for r in fleet]
    assert [r["reward_mean"] for r in alone] == pytest.approx([r["reward_mean"] for r in fleet])
    assert json.loads((solo / "summary.json").read_text())["steps"] == 6


def test_rollout_only_generates_with_fixed_weights_and_the_fleet_columns(tmp_path):
    """No trainer: versions still advance (the rollouts load each), nothing learns or is saved, and the recorded
    behaviour logprobs are those of version 0 (the built, warmed-up policy) at every step."""
    from areal_async.app.workers.policy import warmup
    from areal_async.models.tiny import load_policy
    from areal_async.trainer.persist.recording import read_step, step_path

    run = tmp_path / "ro"
    run_ok(run, "mode=rollout_only", "rollout.dump_tensors=true", "total_train_steps=4")
    rows = read_jsonl(run / "metrics.jsonl")
    assert [(r["step"], r["version"], r["optimizer_steps"]) for r in rows] == [(s, s + 1, 0) for s in range(4)]
    assert {"step_s", "plan_wait_s", "wait_data_s", "train_s", "publish_s", "gen_busy_s_total"} <= set(rows[-1])
    # the rollouts loaded each version: step 3 trains at version 3, so with eta = 1 every sample's head token was
    # made at version >= 2 (a step's rows carry the last update *every* rollout finished: timing, not asserted)
    heads = [int(t.versions[0]) for t in read_step(step_path(run, 3)).trajs]
    assert load_config(run / "config.yaml").rollout.max_head_offpolicyness == 1 and min(heads) >= 2, heads
    assert not (run / "checkpoints").exists()
    cfg = load_config(run / "config.yaml")
    model, tok = load_policy(cfg.model, cfg.seed)
    warmup(cfg, model, tok)
    model.eval()
    for s in (0, 3):
        for t in read_step(step_path(run, s)).trajs[:4]:
            ids = torch.cat([t.prompt_ids, t.output_ids]).long()[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float() / cfg.gconfig.temperature, -1)
            n = t.output_ids.numel()
            mine = logp[-n:].gather(1, t.output_ids.long()[:, None])[:, 0]
            assert torch.allclose(mine, t.logprobs, atol=2e-4), (s, t.sample_id)
