"""Evaluation: the pass@1 interval by hand, the sample -> score plumbing with real math-verify, the CLI,
and the periodic evaluator agreeing with `areal-async eval` on the same weights."""

import json
from pathlib import Path

import pytest

from areal_async.app.workers.evaluate import PeriodicEvaluator, Sampling, evaluate, pass1_interval, run_eval
from areal_async.config import from_dict
from areal_async.data.prompts import Problem, prompt_encoder
from areal_async.models.tiny import build_model, save_policy
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.reward.pool import RewardPool
from areal_async.rollout.engines.engine import RolloutEngine, group_rows, sample_row

ROOT = Path(__file__).resolve().parents[3]


def test_pass1_interval_by_hand():
    # rates 1, 0, .5, .5: mean .5; sample variance (.25+.25)/3 = 1/6; se = sqrt(1/6/4) = 0.2041241
    ci = pass1_interval([1.0, 0.0, 0.5, 0.5])
    assert ci.mean == 0.5 and ci.se == pytest.approx(0.2041241, abs=1e-7)
    assert (ci.low, ci.high) == pytest.approx((0.5 - 1.959964 * 0.2041241, 0.5 + 1.959964 * 0.2041241), abs=1e-6)
    # 1, 1, 1, .5: mean .875, variance .1875/3 = .0625, se = .125; the upper end is clipped to 1
    ci = pass1_interval([1.0, 1.0, 1.0, 0.5])
    assert (ci.mean, ci.se, ci.high) == (0.875, 0.125, 1.0) and ci.low == pytest.approx(0.875 - 0.245, abs=1e-5)
    one = pass1_interval([0.25])
    assert (one.mean, one.se, one.low, one.high) == (0.25, None, None, None)
    with pytest.raises(ValueError, match="no problems"):
        pass1_interval([])


class ScriptedEngine(RolloutEngine):
    """Answers each group with fixed texts (by prompt ids), one step after it was added."""

    def __init__(self, tok, answers: dict[tuple, list[str]]):
        self.tok, self.answers, self.open, self.version = tok, answers, [], 0
        self.seen: list = []

    def add_request(self, req):
        self.seen.append(req)
        self.open.append(req)

    def step(self):
        done, self.open = self.open, []
        return [group_rows([self._sample(r, i, t) for i, t in enumerate(self.answers[tuple(r.prompt_ids)][: r.n])])
                for r in done]  # fmt: skip

    def _sample(self, req, i, text):
        ids = self.tok.encode(text, add_special_tokens=False)
        return sample_row(req, i, ids, [0.0] * len(ids), [self.version] * len(ids), "stop")

    def has_work(self):
        return bool(self.open)

    def update_weights(self, version, state_dict):
        pass

    def abort_all(self):
        return []


def test_evaluate_scores_every_sample_with_the_reward_pool():
    tok = build_char_tokenizer()
    enc = prompt_encoder(tok, "none")
    problems = [Problem(0, "2+2=", ("4",)), Problem(1, "3+5=", ("8",)), Problem(2, "1/2+1/2=", ("1",))]
    answers = {
        tuple(enc("2+2=")): ["\\boxed{4}", "\\boxed{04}"],  # both right (math-verify: 04 = 4)
        tuple(enc("3+5=")): ["\\boxed{9}", "\\boxed{8}"],  # one of two
        tuple(enc("1/2+1/2=")): ["no box 1", "\\boxed{2/2}"],
    }  # unboxed scores 0; 2/2 = 1
    s = Sampling(k=2, greedy=False, temperature=0.6, top_p=0.95, max_new_tokens=8)
    engine = ScriptedEngine(tok, answers)
    with RewardPool(n_procs=1, timeout_s=10) as pool:
        res = evaluate(engine, tok, enc, problems, pool, s)
    assert [r.prompt_ids for r in engine.seen] == [enc(p.prompt) for p in problems]
    assert all((r.n, r.temperature, r.top_p, r.greedy) == (2, 0.6, 0.95, False) for r in engine.seen)
    assert [r["scores"] for r in res.rows] == [[1.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
    assert [r["pass1"] for r in res.rows] == [1.0, 0.5, 0.5]
    # mean 2/3; variance ((1/3)^2 + 2 (1/6)^2) / 2 = 1/12; se = sqrt(1/36) = 1/6
    assert res.summary["pass1"] == pytest.approx(2 / 3) and res.summary["se"] == pytest.approx(1 / 6)
    assert (res.summary["n_problems"], res.summary["k"], res.summary["n_samples"]) == (3, 2, 6)


FAST = ["sft_warmup.steps=5", "evaluator.max_problems=6", "evaluator.max_new_tokens=6", "reward.n_procs=1"]


def test_cli_eval_writes_rows_and_summary_and_refuses_bad_flags(tmp_path, cli):
    out = tmp_path / "ev"
    cmd = [
        "eval",
        str(ROOT / "configs/tiny_arith.yaml"),
        "--out",
        str(out),
        "-k",
        "3",
        *FAST,
    ]
    done = cli(*cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pass@1" in done.stdout and "95% CI" in done.stdout and "samples / problem (k)          3" in done.stdout
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    summary = json.loads((out / "eval_summary.json").read_text())
    assert len(rows) == 6 and all(len(r["scores"]) == len(r["completions"]) == 3 for r in rows)
    assert summary["pass1"] == pytest.approx(sum(r["pass1"] for r in rows) / 6)
    assert summary["ci_low"] <= summary["pass1"] <= summary["ci_high"]
    assert summary["model"].startswith("initial policy") and (summary["k"], summary["temperature"]) == (3, 0.6)
    bad = cli(*cmd[: -len(FAST)], "--greedy")
    assert bad.returncode == 2 and "-k 3 with --greedy" in bad.stderr
    missing = cli(*cmd, "--model", tmp_path / "nope")
    assert missing.returncode == 2 and "nope" in missing.stderr and "config.json" in missing.stderr


def test_periodic_evaluator_agrees_with_eval_on_a_saved_model(tmp_path):
    """The trainer's evaluator on a state dict and `areal-async eval --model` on the same weights saved
    to disk give the same pass@1 (fresh engine seeded alike, same problems and settings)."""
    cfg = from_dict(
        {},
        [
            "evaluator.n_samples=4",
            "evaluator.greedy=false",
            "evaluator.temperature=1.0",
            "evaluator.max_problems=5",
            "evaluator.freq_steps=2",
            "total_train_steps=5",
            "gconfig.max_new_tokens=6",
            "reward.n_procs=1",
        ],
    )
    tok = build_char_tokenizer()
    trained = build_model(cfg.model, len(tok), seed=7)  # weights unlike the evaluator's own initial ones
    save_policy(trained, tok, tmp_path / "model")
    ev = PeriodicEvaluator(cfg, build_model(cfg.model, len(tok), seed=cfg.seed), tok, RewardPool(n_procs=1))
    try:
        assert [v for v in range(6) if ev.due(v)] == [0, 2, 4, 5]  # every 2 versions and the last (5)
        periodic = ev(4, trained.state_dict())
    finally:
        ev.close()
    assert run_eval(cfg, str(tmp_path / "model"), None, tmp_path / "ev") == 0
    summary = json.loads((tmp_path / "ev" / "eval_summary.json").read_text())
    assert periodic["eval_pass1"] == summary["pass1"] and periodic["eval_pass1_ci_low"] == summary["ci_low"]
    assert (periodic["eval_n_problems"], periodic["eval_k"]) == (5, 4)
    completions = [r["completions"] for r in map(json.loads, (tmp_path / "ev" / "eval.jsonl").read_text().splitlines())]
    assert len({c for cs in completions for c in cs}) > 5  # sampled, not one text repeated
