"""Training prompts: the generated tiny task and jsonl datasets (with their error paths)."""

import json

import pytest

from areal_async.config import DatasetConfig
from areal_async.data.prompts import load_jsonl, tiny_arith
from areal_async.reward.math_verify_reward import boxed_math_reward


def test_tiny_arith_answers_are_correct_and_of_one_width():
    probs = tiny_arith(DatasetConfig(size=100, max_operand=9, ops="+"), seed=3)
    assert len(probs) == 100 and len({p.prompt for p in probs}) == 100
    for p in probs:
        a, b = p.prompt[:-1].split("+")
        assert p.solutions == (str(int(a) + int(b)),)
        assert len(p.answer) == len("\\boxed{18}")  # zero-padded: no length/difficulty correlation
    assert all(boxed_math_reward(p.answer, list(p.solutions)) == 1.0 for p in probs[:20])


def test_tiny_arith_mixed_ops_keep_negative_answers_plain():
    probs = tiny_arith(DatasetConfig(size=300, max_operand=3, ops="+-*"), seed=0)
    neg = [p for p in probs if p.solutions[0].startswith("-")]
    assert neg and all(p.answer == f"\\boxed{{{p.solutions[0]}}}" for p in neg)


def test_jsonl_loads_and_names_bad_lines(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(
        json.dumps({"prompt": "1+1=", "solutions": ["2"]})
        + "\n\n"
        + json.dumps({"prompt": "x", "solutions": ["1", "1.0"], "answer": "\\boxed{1}"})
        + "\n"
    )
    probs = load_jsonl(good)
    assert [p.solutions for p in probs] == [("2",), ("1", "1.0")] and probs[1].answer == "\\boxed{1}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "solutions": ["2"]}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_jsonl(bad)
    bad.write_text(json.dumps({"prompt": "q", "solutions": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected"):
        load_jsonl(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no problems"):
        load_jsonl(bad)
