"""benchmarks/gemm_bound.py: the GEMM shapes are the model's linear layers, and the rows are well formed."""

from __future__ import annotations

import torch

from benchmarks import engine_vs_hf, gemm_bound
from areal_async.models.tiny import build_model


def test_linear_shapes_are_the_models_linear_weights():
    """Counted from the built HF model's nn.Linear modules (GQA: k and v narrower than q)."""
    cfg = gemm_bound.model_config("tiny", num_key_value_heads=2, vocab_size=37)
    model = build_model(cfg, 37, seed=0)
    linears = sorted(tuple(m.weight.shape[::-1]) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sorted(gemm_bound.linear_shapes(cfg, 37)) == linears
    assert (64, 32) in linears and (64, 37) in linears  # k/v: 2 heads of 16; the head


def test_the_bound_grows_with_rows_and_tokens():
    shapes = gemm_bound.linear_shapes(gemm_bound.model_config("tiny"), 16)
    assert 0 < gemm_bound.decode_step_s(shapes, 4, repeats=1) < 1
    assert 0 < gemm_bound.train_step_s(shapes, 64, repeats=1) < 5


def test_trainer_and_width_rows_carry_their_fractions():
    rows = gemm_bound.trainer_rows("tiny", 512, repeats=1, skip_hf=False)
    assert [r["metric"] for r in rows] == [
        "trainer_fused_step_fraction_of_gemm_bound",
        "hf_plain_step_fraction_of_gemm_bound",
    ]
    for r in rows:
        assert r["value"] == r["gemm_bound_s"] / r["step_s"] and r["tokens"] == 512
    args = engine_vs_hf._parser().parse_args(["--shapes", "tiny", "--prompts", "2", "--samples", "2"])
    args.new_tokens, args.repeats = 4, 1
    (row,) = engine_vs_hf.width_rows(args)
    assert row["shape"] == "tiny" and row["metric"] == "engine_vs_hf_generate_tokens_per_s_ratio"
    assert row["engine_fraction_of_gemm_bound"] == row["engine_tokens_per_s"] / row["gemm_bound_tokens_per_s"]
