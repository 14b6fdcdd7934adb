"""The pure parts of benchmarks/overhead.py on hand-made inputs (no fleet, no model)."""

import pytest
import torch

from benchmarks import overhead as bench
from benchmarks.common import check_rows
from benchmarks.engine_vs_hf import hf_generate, tokens_until_eos


def rows(n: int, step_s: float, train_s: float, publish_s: float, gen: float, reward: float) -> list[dict]:
    return [
        {
            "step": i,
            "wall_s": 10.0 + i * step_s,
            "train_s": train_s,
            "publish_s": publish_s,
            "gen_busy_s_total": gen * i,
            "reward_busy_s_total": reward * i,
            "reward_mean": 0.5,
        }
        for i in range(n)
    ]


def test_fleet_phases_by_hand():
    ms = bench.fleet_phases(rows(12, step_s=0.2, train_s=0.12, publish_s=0.01, gen=0.05, reward=0.02), warmup=2)
    # every step: wall 200 ms, train 120, publish 10 -> the trainer waited 70; busy counters grow 50 and 20 per step
    assert ms == pytest.approx(
        {"step": 200.0, "train": 120.0, "publish": 10.0, "wait": 70.0, "gen": 50.0, "reward": 20.0}
    )
    with pytest.raises(ValueError, match="at least 4 metrics rows"):
        bench.fleet_phases(rows(3, 0.2, 0.1, 0.0, 0.0, 0.0), warmup=2)


def test_fleet_phases_count_the_forward_run_ahead_as_training():
    window = rows(12, step_s=0.2, train_s=0.09, publish_s=0.01, gen=0.05, reward=0.02)
    for r in window:
        r["ahead_s"] = 0.03  # 30 ms of the step's training ran before its plan came
    ms = bench.fleet_phases(window, warmup=2)
    assert ms["train"] == pytest.approx(120.0) and ms["wait"] == pytest.approx(70.0)


def test_tokens_until_eos_counts_the_first_eos_and_nothing_after():
    new = torch.tensor([[5, 6, 7], [2, 0, 0], [5, 2, 0], [2, 2, 5]])
    assert tokens_until_eos(new, eos=2).tolist() == [3, 1, 2, 1]


def test_rows_meet_the_contract_and_the_targets_are_judged():
    phases = {"gen": 40.0, "reward": 5.0, "train": 45.0, "publish": 2.0, "wait": 0.0, "step": 92.0}
    fleet = {
        0: dict(phases, step=110.4, final_reward=0.5, foreign_cpu_frac=0.0),
        1: dict(phases, step=75.0, final_reward=0.5, foreign_cpu_frac=0.0),
    }
    out = bench.to_rows(phases, fleet, {"engine_tokens_per_s": 3000.0, "hf_tokens_per_s": 1000.0}, {"steps": 60})
    check_rows(out)
    ratio = {r["eta"]: r for r in out if r["metric"] == "fleet_vs_inprocess_ms_per_step_ratio"}
    assert ratio[0]["value"] == pytest.approx(1.2) and ratio[0]["meets_target"] is True  # 110.4 / 92 <= 1.25
    assert ratio[1]["value"] == pytest.approx(75 / 92) and ratio[1]["meets_target"] is False  # 0.815 > 0.8
    (gen,) = [r for r in out if r["metric"] == "engine_vs_hf_generate_tokens_per_s_ratio"]
    assert gen["value"] == pytest.approx(3.0) and gen["meets_target"] is True


def test_each_fleet_run_is_divided_by_the_in_process_legs_around_it():
    """Legs of 90, 100, 80 ms (before η=0, between, after η=1): η=0 (110 ms) against (90 + 100) / 2,
    η=1 (72 ms) against (100 + 80) / 2; the in-process row is the mean of the three legs."""
    legs = [
        {"gen": g, "reward": 5.0, "train": 45.0, "publish": 2.0, "wait": 0.0, "step": st, "cpu": st}
        for g, st in ((38.0, 90.0), (48.0, 100.0), (28.0, 80.0))
    ]
    inproc = bench.mean_legs(legs) | {"legs": [90.0, 100.0, 80.0]}
    assert inproc["step"] == pytest.approx(90.0) and inproc["gen"] == pytest.approx(38.0)
    phases = {"gen": 10.0, "reward": 5.0, "train": 45.0, "publish": 2.0, "wait": 0.0}
    fleet = {
        0: dict(phases, step=110.0, final_reward=0.5, foreign_cpu_frac=0.0, inprocess_step=95.0),
        1: dict(phases, step=72.0, final_reward=0.5, foreign_cpu_frac=0.0, inprocess_step=90.0),
    }
    out = bench.to_rows(inproc, fleet, None, {"steps": 60})
    check_rows(out)
    ratio = {r["eta"]: r for r in out if r["metric"] == "fleet_vs_inprocess_ms_per_step_ratio"}
    assert ratio[0]["value"] == pytest.approx(110 / 95) and ratio[0]["inprocess_ms"] == 95.0
    assert ratio[1]["value"] == pytest.approx(0.8) and ratio[1]["meets_target"] is True
    (row,) = [r for r in out if r["metric"] == "ms_per_step" and r["mode"] == "inprocess"]
    assert row["value"] == pytest.approx(90.0) and row["legs_ms"] == [90.0, 100.0, 80.0]


def test_hf_shared_prefill_baseline_samples_what_per_sample_prefill_samples():
    """The HF baseline with the prompt prefix prefilled once and its cache repeated draws, from the
    same seed, the same tokens as generate's own per-sample prefill (mixed prompt lengths, left
    padding): the shared prefill changes HF's cost, not what it computes."""
    import torch

    from areal_async.config import ModelConfig
    from areal_async.models.tiny import build_model
    from areal_async.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    model = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2), len(tok), seed=3)
    prompts = [tok.encode(p) for p in ("1+2=", "7=", "12+30=", "5")]
    news = []
    for shared in (True, False):
        torch.manual_seed(11)
        gen = hf_generate(model, prompts, 3, 5, None, tok.pad_token_id, 1.0, 1.0, shared=shared)
        news.append(gen())
    assert news[0].shape == (12, 5)
    assert torch.equal(news[0], news[1])
