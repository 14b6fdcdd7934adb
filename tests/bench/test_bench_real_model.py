"""benchmarks/real_model.py on a small model of the real one's architecture (2 layers of SmolLM2's shape
narrowed, GQA, tied head): the rows are well formed, the token counts are what was asked, the ratio rows are
the medians' quotients, the linear shapes are the model's, and the memory formula's terms add up by hand."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from areal_async.models import lean_ops
from benchmarks import real_model
from benchmarks.common import check_rows
from benchmarks.results import real_model as render

CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=300, tie_word_embeddings=True, max_position_embeddings=256)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("small")
    LlamaForCausalLM(LlamaConfig(**CFG)).save_pretrained(str(path))
    return path


def test_generation_rows_without_vllm(model_dir):
    args = real_model._parser().parse_args(
        ["generation", "--model", str(model_dir), "--batches", "2,3", "--prompt", "5", "--new", "4"]
        + ["--rounds", "2", "--no-vllm", "--engines", "auto,packed"]
    )
    rows = real_model.generation(args)
    check_rows(rows)
    rates = {(r["generator"], r["batch"]): r for r in rows if r["metric"] == "real_model_generation_tokens_per_s"}
    assert sorted(rates) == [(g, b) for g in ("bound", "engine", "engine_packed", "hf") for b in (2, 3)]
    assert all(len(r["samples"]) == 2 and r["threads"] == 1 for r in rates.values())
    assert rates[("engine_packed", 3)]["settings"].endswith("linears packed")
    vs_hf = {(r["engine"], r["batch"]): r for r in rows if r["metric"] == "real_model_engine_vs_hf"}
    assert sorted(vs_hf) == [(g, b) for g in ("engine", "engine_packed") for b in (2, 3)]
    r2 = vs_hf[("engine_packed", 2)]
    assert r2["value"] == rates[("engine_packed", 2)]["value"] / rates[("hf", 2)]["value"] and r2["target"] == 2.0
    shares = {(r["generator"], r["batch"]): r["value"] for r in rows if "fraction_of_gemm_bound" in r["metric"]}
    assert sorted(shares) == [(g, b) for g in ("engine", "engine_packed", "hf") for b in (2, 3)]
    assert shares[("hf", 3)] == rates[("hf", 3)]["value"] / rates[("bound", 3)]["value"]
    assert not [r for r in rows if "vllm" in r["metric"]]
    assert render([dict(r, benchmark="benchmarks.real_model") for r in rows])[0].startswith("| metric")


def test_an_unknown_engine_kernel_is_refused_before_anything_runs():
    args = real_model._parser().parse_args(
        ["generation", "--model", "/nonexistent", "--engines", "auto,mkl", "--no-vllm"]
    )
    with pytest.raises(ValueError, match=r"--engines auto,mkl: \['mkl'\] not among"):
        real_model.generation(args)  # refused before the (missing) model is read


def test_both_generators_make_every_token_asked_for(model_dir):
    """No eos: B prompts x `new` tokens each, for the engine and for HF generate."""
    model = real_model.load_model(model_dir)
    prompts = real_model.prompts_for(3, 5, CFG["vocab_size"])
    assert real_model.engine_runner(model, 6)(prompts) == 18
    assert real_model.hf_runner(model, 6)(prompts) == 18


def test_the_bound_multiplies_the_prefill_and_the_decode_steps(model_dir):
    """FLOPs by hand for CFG: a layer's (in, out) products sum to 64*64*2 + 64*32*2 + 64*96*2 + 96*64 = 30,720,
    two layers 61,440, the head 64*300 = 19,200. B = 3 prompts of 5 tokens, 4 new: the prefill multiplies 15 rows
    by the layers and 3 by the head, then 3 decode steps multiply 3 rows by everything."""
    run = real_model.bound_runner(real_model.load_model(model_dir), 4, [3], 5)
    prefill, decode = 2 * (15 * 61_440 + 3 * 19_200), 3 * 2 * 3 * (61_440 + 19_200)
    assert run.flops == {3: prefill + decode} == {3: 3_409_920}
    assert run(real_model.prompts_for(3, 5, CFG["vocab_size"])) == 12


def test_linear_shapes_are_the_models_linear_weights(model_dir):
    model = real_model.load_model(model_dir)
    linears = sorted(tuple(m.weight.shape[::-1]) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sorted(real_model._linear_shapes(model.config)) == linears


def test_training_rows(model_dir):
    args = argparse.Namespace(
        model=str(model_dir), threads=1, tokens=64, seq=16, rounds=2, chunk_tokens=16, linears="blas,onednn"
    )
    rows = real_model.training(args)
    check_rows(rows)
    steps = {r["variant"]: r for r in rows if r["metric"] == "real_model_train_step_s"}
    assert sorted(steps) == ["bound", "hf_step", "trainer_step_blas", "trainer_step_onednn"]
    assert steps["trainer_step_blas"]["tokens"] == 64
    assert steps["trainer_step_blas"]["chunk_tokens"] == 0  # 64 x 300 x 4 bytes of logits: far below the limit
    vs = [r for r in rows if r["metric"] == "real_model_trainer_vs_hf_step"]
    assert [v["linears"] for v in vs] == ["blas", "onednn"] and all(len(v["per_round"]) == 2 for v in vs)
    assert not lean_ops.onednn_chosen()  # the timed steps leave the process on F.linear


def test_the_memory_formula_by_hand():
    cfg = LlamaConfig(**CFG)
    # per token and layer: 4 E + 5 Q + 4 M floats = 256 + 320 + 384 = 960; 2 layers, 100 tokens, 4 bytes
    t = real_model.predict_trainer(cfg, n_params=1000, tokens=100, chunk=0, ckpt=False, base=7)
    assert t == dict(runtime=7, weights=4000, gradients=4000, adam=8000, activations=2 * 960 * 100 * 4,
                     logits=5 * 100 * 300 * 4)  # fmt: skip
    c = real_model.predict_trainer(cfg, n_params=1000, tokens=100, chunk=32, ckpt=True, base=7)
    assert c["activations"] == 2 * 64 * 100 * 4 + 960 * 100 * 4 and c["logits"] == 3 * 32 * 300 * 4
    e = real_model.predict_engine(cfg, n_params=1000, rows=10, columns=20, base=0)
    assert e["kv_cache"] == 2 * 2 * 2 * 16 * 4 * 10 * 20 and e["packed_head"] == 4 * 300 * 64
