"""The table of benchmarks/off_policy.py on a hand-written run directory (no fleet is started)."""

import json

import pytest

from benchmarks import off_policy as bench


def write_run(run_dir, rows, evals=(), meta=None):
    run_dir.mkdir()
    lines = [json.dumps(r) for r in rows] + [json.dumps({"kind": "eval", **e}) for e in evals]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if meta:
        (run_dir / "bench.json").write_text(json.dumps(meta))


def row(step, wall, reward, trained, wasted, version=None, wu=None, recompute=0.0, tail=0.0):
    r = {"step": step, "wall_s": wall, "reward_mean": reward, "trained_tokens": trained, "wasted_tokens": wasted}
    r["tail_s"] = tail
    if version is not None:
        r |= {"weight_update_version": version, "weight_update_s": wu, "weight_update_recompute_s": recompute}
    return r


def test_the_columns_by_hand(tmp_path):
    rows = [
        row(0, 10.0, 0.2, 100, 0, tail=1.0),
        row(1, 12.0, 0.4, 100, 20, version=1, wu=0.5, recompute=0.3, tail=0.5),
        row(2, 14.0, 0.6, 100, 0, version=1, wu=0.5, recompute=0.3, tail=0.0),  # the same update repeated
        row(3, 18.0, 0.8, 200, 40, version=2, wu=1.5, recompute=0.1, tail=2.0),
    ]
    evals = [{"version": 0, "eval_pass1": 0.1, "wall_s": 5.0}, {"version": 4, "eval_pass1": 0.55, "wall_s": 19.0}]
    write_run(tmp_path / "r", rows, evals, {"mode": "keep", "seed": 2, "loadavg_before": 1.5, "foreign_cpu_frac": 0.1})
    s = bench.summarize(tmp_path / "r", target=0.5)
    # tokens after step 0: (100 + 20) + (100 + 0) + (200 + 40) = 460 over 18 - 10 = 8 s
    assert s["gen_tok_s"] == pytest.approx(57.5) and s["value"] == s["gen_tok_s"]
    assert s["wasted_per_trained"] == pytest.approx(60 / 500)
    # versions 1 and 2 once each: medians of (0.5, 1.5) and (0.3, 0.1)
    assert (s["wu_p50"], s["recompute_p50"]) == (pytest.approx(1.0), pytest.approx(0.2))
    assert s["tail_p50"] == pytest.approx(0.75)  # median of 1, 0.5, 0, 2
    assert (s["pass1_end"], s["eval_steps_to_target"], s["eval_wall_to_target"]) == (0.55, 4, 19.0)
    assert s["steps_to_target"] is None  # fewer than 10 steps: no trailing mean yet
    assert (s["mode"], s["seed"], s["loadavg_before"]) == ("keep", 2, 1.5)


def test_the_reward_target_needs_a_full_trailing_window(tmp_path):
    rows = [row(k, 10.0 + k, 0.4 if k < 12 else 0.9, 10, 0) for k in range(20)]
    write_run(tmp_path / "r", rows)
    # trailing 10-step means: at step 15 (steps 6..15) 6 x 0.4 + 4 x 0.9 = 0.60 < 0.62; at step 16 (7..16)
    # 5 x 0.4 + 5 x 0.9 = 0.65 >= 0.62: the 17th step, at wall 26
    s = bench.summarize(tmp_path / "r", target=0.62)
    assert (s["steps_to_target"], s["wall_to_target"]) == (17, 26.0)
    assert s["mode"] == "r" and s["pass1_end"] is None
