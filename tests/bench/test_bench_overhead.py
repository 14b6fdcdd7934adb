"""The pure parts of benchmarks/overhead.py on hand-made inputs (no fleet, no model)."""

import pytest
import torch

from benchmarks import overhead as bench
from benchmarks.common import check_rows
from benchmarks.common.inprocess import InProcessLoop
from benchmarks.common.legs import find, ratio_rows
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


def _leg(step: float, cpu: float, gen: float = 38.0) -> dict:
    return {"gen": gen, "reward": 5.0, "train": 45.0, "publish": 2.0, "wait": 0.0, "step": step, "cpu": cpu}


def _fleet(step: float, cpu: float) -> dict:
    phases = {"gen": 10.0, "reward": 5.0, "train": 45.0, "publish": 2.0, "wait": 0.0}
    return dict(phases, step=step, cpu=cpu, final_reward=0.5, foreign_cpu_frac=0.0)


def test_rows_meet_the_contract_and_the_targets_are_judged():
    legs = {"plain": {"legs": [_leg(92.0, 90.0)] * 3}}
    fleet = {0: _fleet(110.4, 99.0), 1: _fleet(75.0, 81.0)}
    out = bench.to_rows(legs, fleet, {"engine_tokens_per_s": 3000.0, "hf_tokens_per_s": 1000.0}, {"steps": 60})
    check_rows(out)
    ratio = {r["eta"]: r for r in out if r["metric"] == "fleet_vs_inprocess_ms_per_step_ratio"}
    assert ratio[0]["value"] == pytest.approx(1.2) and ratio[0]["meets_target"] is True  # 110.4 / 92 <= 1.25
    assert ratio[1]["value"] == pytest.approx(75 / 92) and ratio[1]["meets_target"] is False  # 0.815 > 0.8
    cpu = {r["eta"]: r for r in out if r["metric"] == "fleet_vs_inprocess_cpu_ms_per_step_ratio"}
    assert cpu[0]["value"] == pytest.approx(1.1) and cpu[0]["target"] is None  # 99 / 90; CPU rows judge nothing
    (gen,) = [r for r in out if r["metric"] == "engine_vs_hf_generate_tokens_per_s_ratio"]
    assert gen["value"] == pytest.approx(3.0) and gen["meets_target"] is True


def test_each_fleet_run_is_divided_by_the_legs_around_it_and_by_the_first_leg():
    """Legs of 90, 100, 80 ms (before η=0, between, after η=1): η=0 (110 ms) against (90 + 100) / 2 = 95
    and against the first leg, 90; η=1 (72 ms) against (100 + 80) / 2 = 90 and against 90. CPU the same
    way: legs 60, 70, 50 ms of CPU, the fleet 78 and 66 -> 78 / 65 = 1.2, 78 / 60 = 1.3, 66 / 60 = 1.1."""
    legs = [_leg(90.0, 60.0, gen=38.0), _leg(100.0, 70.0, gen=48.0), _leg(80.0, 50.0, gen=28.0)]
    fleet = {0: _fleet(110.0, 78.0), 1: _fleet(72.0, 66.0)}
    out = bench.to_rows({"plain": {"legs": legs}}, fleet, None, {"steps": 60})
    check_rows(out)

    def val(metric, eta):
        return find(out, metric, eta, "plain")

    assert val("fleet_vs_inprocess_ms_per_step_ratio", 0) == pytest.approx(110 / 95)
    assert val("fleet_vs_inprocess_ms_per_step_first_leg_ratio", 0) == pytest.approx(110 / 90)
    assert val("fleet_vs_inprocess_ms_per_step_ratio", 1) == pytest.approx(0.8)
    assert val("fleet_vs_inprocess_ms_per_step_first_leg_ratio", 1) == pytest.approx(0.8)
    assert val("fleet_vs_inprocess_cpu_ms_per_step_ratio", 0) == pytest.approx(1.2)
    assert val("fleet_vs_inprocess_cpu_ms_per_step_first_leg_ratio", 0) == pytest.approx(1.3)
    assert val("fleet_vs_inprocess_cpu_ms_per_step_ratio", 1) == pytest.approx(1.1)
    (row,) = [r for r in out if r["metric"] == "ms_per_step" and r["mode"] == "inprocess"]
    assert row["value"] == pytest.approx(90.0) and row["gen_ms"] == pytest.approx(38.0)
    assert row["legs_ms"] == [90.0, 100.0, 80.0] and row["legs_cpu_ms"] == [60.0, 70.0, 50.0]


def test_the_null_run_and_both_baselines_get_the_same_accounting():
    """Null run of the matched loop: legs 50, 60, 40 ms with stand-ins 66 (η=0) and 45 (η=1) between them:
    66 / 55 = 1.2 and 45 / 50 = 0.9 against the legs around, 66 / 50 = 1.32 and 45 / 50 = 0.9 against the
    first leg. The null run judges no target; each baseline's rows carry its name."""
    plain = {"legs": [_leg(90.0, 60.0)] * 3}
    matched = {
        "legs": [_leg(80.0, 55.0)] * 3,
        "null_legs": [_leg(50.0, 50.0), _leg(60.0, 60.0), _leg(40.0, 40.0)],
        "null_stand_ins": {0: _leg(66.0, 44.0), 1: _leg(45.0, 60.0)},
    }
    fleet = {0: _fleet(96.0, 66.0), 1: _fleet(72.0, 66.0)}
    out = bench.to_rows({"plain": plain, "matched": matched}, fleet, None, {"steps": 60})
    check_rows(out)
    assert find(out, "null_vs_inprocess_ms_per_step_ratio", 0, "matched") == pytest.approx(1.2)
    assert find(out, "null_vs_inprocess_ms_per_step_ratio", 1, "matched") == pytest.approx(0.9)
    assert find(out, "null_vs_inprocess_ms_per_step_first_leg_ratio", 0, "matched") == pytest.approx(1.32)
    assert find(out, "null_vs_inprocess_cpu_ms_per_step_ratio", 0, "matched") == pytest.approx(44 / 55)
    assert find(out, "null_vs_inprocess_ms_per_step_ratio", 0, "plain") is None  # the plain loop had no null run
    assert all(r["target"] is None for r in out if r["metric"].startswith("null_"))
    assert find(out, "fleet_vs_inprocess_ms_per_step_ratio", 0, "matched") == pytest.approx(1.2)  # 96 / 80
    assert find(out, "fleet_vs_inprocess_ms_per_step_ratio", 0, "plain") == pytest.approx(96 / 90)
    (m,) = [r for r in out if r["metric"] == "ms_per_step" and r.get("baseline") == "matched"]
    assert m["null_legs_ms"] == [50.0, 60.0, 40.0] and m["null_stand_in_ms"] == [66.0, 45.0]
    lines = {(x["subject"], x["eta"], x["baseline"]): x for x in bench.ratio_table(out)}
    assert lines[("null", 1, "matched")]["fleet_vs_inprocess_ms_per_step_first_leg_ratio"] == pytest.approx(0.9)
    assert lines[("fleet", 0, "plain")]["target"] == 1.25


def test_ratio_rows_refuse_legs_that_do_not_surround_the_runs():
    with pytest.raises(ValueError, match="2 runs need 3 legs"):
        ratio_rows("fleet", {0: {"step": 1.0}, 1: {"step": 1.0}}, [{"step": 1.0}] * 2, "plain", {}, {})


def test_a_missing_cpu_figure_leaves_the_cpu_ratio_empty_not_wrong():
    out = ratio_rows("fleet", {0: {"step": 90.0, "cpu": None}}, [{"step": 90.0, "cpu": 80.0}] * 2, "plain", {}, {})
    check_rows(out)
    assert find(out, "fleet_vs_inprocess_cpu_ms_per_step_ratio", 0, "plain") is None
    assert find(out, "fleet_vs_inprocess_ms_per_step_ratio", 0, "plain") == pytest.approx(1.0)


def test_the_matched_loop_builds_the_same_trajectories_as_the_plain_one(tmp_path):
    """The matched loop's scoring (batched decode, packed views, one prompt tensor a group) gives the
    trainer the same samples, scores and per-token values as the plain loop's, from the same groups."""
    from areal_async.config import load_config

    model_dir, data = bench.build_setup(tmp_path)
    cfg = load_config(bench.BASE_CONFIG, bench.overrides(model_dir, data, steps=3))
    loop = InProcessLoop(cfg, matched=True)
    groups = loop._generate()
    plain, matched = loop._score(groups), loop._score_packed(groups)
    assert len(plain) == len(matched) == cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    for a, b in zip(plain, matched):
        assert (a.sample_id, a.group_id, a.score) == (b.sample_id, b.group_id, b.score)
        for f in ("prompt_ids", "output_ids", "logprobs", "versions"):
            assert torch.equal(getattr(a, f).to(getattr(b, f).dtype), getattr(b, f)), f
    assert {t.score for t in plain} <= {0.0, 1.0}


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


def test_results_tabulates_the_rows_it_is_given():
    """The RESULTS.md renderer's overhead table: one line per η and loop, the rows' own ratios (110 / 95,
    110 / 90 from the legs 90 and 100 around the run), '-' where a framing has no row (no null run)."""
    from benchmarks import results

    legs = {"plain": {"legs": [_leg(90.0, 60.0), _leg(100.0, 70.0)]}}
    out = bench.to_rows(legs, {0: _fleet(110.0, 78.0)}, None, {"loadavg_before": 1.5, "loadavg_after": 2.5})
    rows = results.stamp(out, "hand", "abc1234", "2026-12-02")
    assert rows[0]["benchmark"] == "benchmarks.overhead" and rows[0]["load"] == "1-minute load average 1.5-2.5"
    md = results.render_run(("2026-12-02", "hand", "abc1234"), rows, [])
    assert md[0] == "### 2026-12-02: hand" and "load average 1.5-2.5" in md[2] and "`abc1234`" in md[2]
    (line,) = [x for x in md if x.startswith("| 0 | plain")]
    assert line.split(" | ")[2:7] == ["1.158", "1.222", "1.200", "1.300", "-"]
    assert not any(x.startswith("| 0 | matched |") and "1." in x for x in md)  # no matched rows: dashes only
