"""benchmarks/gemm_bound.py: the GEMM shapes are the model's linear layers, and the rows are well formed."""

from __future__ import annotations

import pytest
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
    rows = gemm_bound.trainer_rows("tiny", 512, repeats=2, skip_hf=False)
    assert [r["metric"] for r in rows] == [
        "trainer_fused_step_fraction_of_gemm_bound",
        "hf_plain_step_fraction_of_gemm_bound",
        "trainer_fused_step_vs_hf_plain_step",
    ]
    for r in rows[:2]:
        assert len(r["step_s_samples"]) == len(r["gemm_bound_s_samples"]) == 2 and r["tokens"] == 512
    args = engine_vs_hf._parser().parse_args(["--shapes", "tiny", "--prompts", "2", "--samples", "2"])
    args.new_tokens, args.repeats = 4, 1
    (row,) = engine_vs_hf.width_rows(args)
    assert row["shape"] == "tiny" and row["metric"] == "engine_vs_hf_generate_tokens_per_s_ratio"
    assert row["engine_fraction_of_gemm_bound"] == row["engine_tokens_per_s"] / row["gemm_bound_tokens_per_s"]


def test_interleaved_rounds_time_each_once_a_round_in_a_rotated_order():
    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("bound", "fused", "hf")}
    got = gemm_bound.interleaved(fns, repeats=3)
    warmup, rounds = calls[:3], calls[3:]
    assert warmup == ["bound", "fused", "hf"]
    assert rounds == ["bound", "fused", "hf", "fused", "hf", "bound", "hf", "bound", "fused"]
    assert {k: len(v) for k, v in got.items()} == {"bound": 3, "fused": 3, "hf": 3}


def test_the_fused_step_against_hf_is_said_from_the_medians():
    """Rounds of 1.3/0.9, 1.27/1.0, 1.2/1.1 s: ratios 1.444, 1.27, 1.091, median 1.27: 27 % slower."""
    got = {"trainer_fused_step": [1.3, 1.27, 1.2], "hf_plain_step": [0.9, 1.0, 1.1]}
    row = gemm_bound._vs_hf("real", 1024, got, recompute_s=0.2)
    assert row["value"] == pytest.approx(1.27) and row["metric"] == "trainer_fused_step_vs_hf_plain_step"
    assert row["ratio_per_round"] == [1.4444, 1.27, 1.0909]
    assert row["said"] == (
        "the trainer's fused step is 27% slower than a plain HF step at the real shape "
        "(1024 tokens, median of 3 interleaved rounds; its chunked head's recompute: 0.20 s of 1.27 s)"
    )
    # a round slowed by load on both sides (4.0 / 2.0) moves the medians' ratio, not the median ratio much
    got = {"trainer_fused_step": [1.3, 1.27, 4.0], "hf_plain_step": [1.0, 1.0, 2.0]}
    assert gemm_bound._vs_hf("real", 1024, got, 0.2)["value"] == pytest.approx(1.3)
