"""``areal-async data filter``: the band by hand, known pass rates through the real reward pool, the CLI."""

import json
from pathlib import Path

import pytest
from test_evaluate import ScriptedEngine

from areal_async.app.commands import data_filter
from areal_async.app.commands.data_filter import Band, verdict
from areal_async.config import from_dict
from areal_async.data.prompts import prompt_encoder
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[3]


def test_band_parsing_and_verdicts():
    assert (0.0 in Band.parse("[0,1)"), 0.875 in Band.parse("[0,1)"), 1.0 in Band.parse("[0,1)")) == (True, True, False)
    b = Band.parse("(0.25, 0.75]")
    assert [verdict(r, b) for r in (0.0, 0.25, 0.5, 0.75, 1.0)] == ["too_hard", "too_hard", "kept", "kept", "too_easy"]
    assert str(Band.parse("0.2,0.8")) == "[0.2,0.8]"
    for bad in ("0.5", "[0.8,0.2]", "[0,2)", "{0,1}"):
        with pytest.raises(ValueError, match="--band"):
            Band.parse(bad)


def test_filter_keeps_the_band_by_rates_scored_in_the_reward_pool(tmp_path, monkeypatch):
    """Scripted completions give known rates (2/2, 1/2, 0/2); the reward pool scores them for real."""
    tok = build_char_tokenizer()
    enc = prompt_encoder(tok, "none")
    rows = [
        {"prompt": "2+2=", "solutions": ["4"]},
        {"prompt": "3+5=", "solutions": ["8"], "answer": "\\boxed{8}"},
        {"prompt": "9+9=", "solutions": ["18"]},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = {
        tuple(enc("2+2=")): ["\\boxed{4}", "\\boxed{4}"],
        tuple(enc("3+5=")): ["\\boxed{8}", "\\boxed{7}"],
        tuple(enc("9+9=")): ["\\boxed{17}", "18"],
    }  # the last one is unboxed: scores 0
    cfg = from_dict({}, ["evaluator.n_samples=2", "evaluator.greedy=false", "reward.n_procs=1"])
    monkeypatch.setattr(data_filter, "eval_policy", lambda c, d: (build_model(c.model, len(tok), 1), tok, "scripted"))
    monkeypatch.setattr(data_filter, "eval_engine", lambda c, m, t: ScriptedEngine(tok, answers))
    counts = data_filter.filter_data(cfg, str(data), tmp_path / "kept.jsonl", Band.parse("[0,1)"), None)
    assert counts == {"model": "scripted", "band": "[0,1)", "k": 2, "read": 3, "kept": 2, "too_easy": 1, "too_hard": 0}
    kept = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert kept == rows[1:]  # the answer field travels with its problem
    rates = [json.loads(line) for line in (tmp_path / "kept.jsonl.rates.jsonl").read_text().splitlines()]
    assert [(r["pass1"], r["verdict"]) for r in rates] == [(1.0, "too_easy"), (0.5, "kept"), (0.0, "kept")]
    counts = data_filter.filter_data(cfg, str(data), tmp_path / "mid.jsonl", Band.parse("(0,1)"), None)
    assert (counts["kept"], counts["too_easy"], counts["too_hard"]) == (1, 1, 1)


def test_cli_filter_runs_and_refuses_a_bad_band(tmp_path, cli):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "solutions": [str(a + 1)]}) + "\n" for a in range(3)))
    cmd = [
        "data",
        "filter",
        str(ROOT / "configs/tiny_arith.yaml"),
        "--data",
        str(data),
        "-o",
        str(tmp_path / "out.jsonl"),
        "-k",
        "2",
        "sft_warmup.steps=5",
        "evaluator.max_new_tokens=6",
        "reward.n_procs=1",
    ]
    done = cli(*cmd, "--band", "[0,1]")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 problems, k=2, band [0,1]" in done.stdout and "3 kept, 0 too easy, 0 too hard" in done.stdout
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    bad = cli(*cmd, "--band", "[0.9,0.1]")
    assert bad.returncode == 2 and "--band '[0.9,0.1]': expected 0 <= low <= high <= 1" in bad.stderr
