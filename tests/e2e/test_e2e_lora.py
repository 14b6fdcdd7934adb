"""A LoRA run of the tiny preset as a real fleet: the trainer publishes the adapter alone every version, the
rollouts generate with it (the run completes only if they load every version), the base is written once
and the checkpoint holds the adapter alone; the run ends with its policy merged into a plain model
(RUN_DIR/model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal_async import Fleet, load_config
from areal_async.models.lora import load_adapter

ROOT = Path(__file__).resolve().parents[2]
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj,v_proj]"]
FAST = [
    "total_train_steps=4",
    "sft_warmup.steps=60",  # rewards that vary within a group (score ~0.4): the adapter gets gradients
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "saver.freq_steps=2",
    "cluster.heartbeat_s=0.5",
]


@pytest.mark.slow
def test_a_lora_run_publishes_and_checkpoints_the_adapter_alone(tmp_path):
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", FAST + LORA)
    run = tmp_path / "run"
    with Fleet(cfg, run_dir=run) as fleet:
        assert fleet.wait(timeout=900) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # tiny_arith: hidden 128, 4 KV heads of 32 (k/v out 128), 2 layers; q and v: r (128 + 128) each, float32
    adapter_bytes = 2 * 2 * 4 * (128 + 128) * 4
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {r["publish_bytes"] for r in rows} == {adapter_bytes}
    # the rollouts loaded adapters v1, v2: step 3 trains at version 3 and eta = 1 holds every head token to >= 2
    # (a row's weight_update_version is the last update *every* rollout finished by then: timing, not asserted)
    steps = [json.loads(line) for line in (run / "trainer_steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["version_min"] >= s["step"] - 1) for s in steps] == [(k, True) for k in range(4)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_trained"] == 4 * 4 * 4
    assert (run / "lora_base" / "model.safetensors").is_file()
    ckpt = run / "checkpoints" / "step_3"
    assert not (ckpt / "model.safetensors").exists()
    sd, spec = load_adapter(ckpt / "adapter")
    assert spec.rank == 4 and sorted({k.split(".")[-3] for k in sd}) == ["q_proj", "v_proj"]
    assert sum(t.numel() * 4 for t in sd.values()) == adapter_bytes
    assert any(r["grad_norm"] > 0 and r["optimizer_steps"] > 0 for r in rows)
    assert any(t.abs().sum() > 0 for k, t in sd.items() if "lora_B" in k)  # B starts at zero: it trained
    # the run's final policy (RUN_DIR/model): a plain model, the base with W + (alpha / r) B A at every
    # adapted layer, merged here by hand from the last checkpoint's adapter file
    base = load_file(run / "lora_base" / "model.safetensors")
    raw = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    final = load_file(run / "model" / "model.safetensors")
    assert final.keys() == base.keys()
    merged = 0
    for name, w in base.items():
        a = raw.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            assert final[name].equal(w), name
            continue
        b = raw[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
        torch.testing.assert_close(final[name], w + (8 / 4) * (b @ a), rtol=0, atol=1e-6)
        merged += 1
    assert merged == 2 * 2  # q_proj and v_proj of 2 layers
    assert AutoModelForCausalLM.from_pretrained(run / "model", local_files_only=True).num_parameters() == sum(
        t.numel() for t in base.values()
    )
