"""Training prompts: the generated tiny task and jsonl datasets (with their error paths)."""

import json

import pytest

from areal_async.app.workers.evaluate import eval_problems
from areal_async.config import DatasetConfig, from_dict
from areal_async.config.base import ConfigError
from areal_async.data.problem import Problem
from areal_async.data.prompts import load_jsonl, load_problems, split_holdout, tiny_arith
from areal_async.scheduler.runlog import RunLog
from areal_async.scheduler.start import build_core
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


def test_tiny_arith_tool_share_answers_some_problems_with_calculator_traces_and_moves_nothing_else():
    cfg = dict(size=400, max_operand=99, ops="+")
    plain = tiny_arith(DatasetConfig(**cfg), seed=3)
    mixed = tiny_arith(DatasetConfig(**cfg, tool_share=0.3), seed=3)
    every = tiny_arith(DatasetConfig(**cfg, tool_share=1.0), seed=3)
    same = [(p.prompt, p.solutions) for p in plain]
    assert same == [(p.prompt, p.solutions) for p in mixed] == [(p.prompt, p.solutions) for p in every]
    for p in every:  # "a+b=" -> "<<a+b=", the tool's "SUM>>", "\boxed{SUM}" (unpadded: the tool's digits)
        a, b = p.prompt[:-1].split("+")
        total = str(int(a) + int(b))
        assert p.answer == (f"<<{a}+{b}=", f"{total}>>", f"\\boxed{{{total}}}")
        assert boxed_math_reward("".join(p.answer), list(p.solutions)) == 1.0
    traced = [q for q in mixed if isinstance(q.answer, tuple)]
    assert 0.24 * 400 <= len(traced) <= 0.36 * 400  # Binomial(400, 0.3): mean 120, sd 9.2; a seeded draw
    assert all(q.answer == e.answer for q, e in zip(mixed, every) if isinstance(q.answer, tuple))
    assert all(q.answer == p.answer for q, p in zip(mixed, plain) if isinstance(q.answer, str))
    with pytest.raises(ConfigError, match="tool_share"):
        DatasetConfig(tool_share=1.5).validate()


def test_jsonl_answer_may_be_a_tool_trace_of_odd_length(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = ["<<3+4=", "7>>", "\\boxed{7}"]
    path.write_text(json.dumps({"prompt": "3+4=", "solutions": ["7"], "answer": trace}) + "\n")
    assert load_jsonl(path)[0].answer == ("<<3+4=", "7>>", "\\boxed{7}")
    good = json.dumps({"prompt": "q", "solutions": ["7"]})
    for bad, shown in ((trace[:2], "['<<3+4=', '7>>']"), (["a", 1, "b"], "['a', 1, 'b']"), ({"x": 1}, "{'x': 1}")):
        path.write_text(good + "\n" + json.dumps({"prompt": "q", "solutions": ["7"], "answer": bad}) + "\n")
        with pytest.raises(ValueError, match=r't.jsonl:2: "answer" must be a string or an odd-length list') as e:
            load_jsonl(path)
        assert str(e.value).endswith("got " + shown)


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


def _problems(prompts: str) -> list:
    return [Problem(i, p, ("0",)) for i, p in enumerate(prompts.split())]


def test_holdout_is_the_last_distinct_prompts_and_no_training_problem_repeats_one():
    # a b c a d c b e: walking back, e b c d are the last 4 distinct prompts (the trailing b and c
    # count once); the training problems are what is left without those prompts: a (twice)
    probs = _problems("a b c a d c b e")
    train, held = split_holdout(probs, 4)
    assert [p.prompt for p in held] == ["d", "c", "b", "e"]  # in their order, at their last occurrence
    assert [probs[i].prompt for i in train] == ["a", "a"]
    assert split_holdout(probs, 0) == (list(range(8)), [])
    with pytest.raises(ValueError, match="holdout=5: the 8 problems hold 5 distinct prompts"):
        split_holdout(probs, 5)  # nothing left to train on


def test_holdout_of_a_generated_task_is_refused_when_it_is_not_below_size():
    with pytest.raises(ConfigError, match="holdout"):
        DatasetConfig(size=10, holdout=10)


def test_the_scheduler_never_issues_a_held_out_problem_and_eval_takes_them(tmp_path):
    cfg = from_dict({}, ["train_dataset.size=81", "train_dataset.holdout=20", "evaluator.max_problems=0"])
    problems = tiny_arith(cfg.train_dataset, cfg.seed)
    held = {p.prompt for p in problems[-20:]}  # tiny_arith's prompts are distinct: the last 20 are held out
    core, lengths, _ = build_core(cfg, lambda text: [ord(c) for c in text], RunLog(tmp_path, False, []))
    assert lengths.n_total == 61 and len(lengths.kept) == 61
    issued = {"".join(map(chr, core.problem(i)[0])) for i in range(len(lengths.kept))}
    assert len(issued) == 61 and not issued & held
    assert [p.prompt for p in eval_problems(cfg)] == [p.prompt for p in problems[-20:]]


def test_the_instruction_follows_every_prompt_of_every_source(tmp_path):
    plain = load_problems(DatasetConfig(size=5), seed=3)
    told = load_problems(DatasetConfig(size=5, instruction="Answer briefly."), seed=3)
    assert [p.prompt for p in told] == [f"{p.prompt} Answer briefly." for p in plain]
    assert [p.solutions for p in told] == [p.solutions for p in plain]  # the references are untouched
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps({"prompt": "2+2=", "solutions": ["4"]}) + "\n")
    assert load_problems(DatasetConfig(type="jsonl", path=str(lines), instruction="Go."), 0)[0].prompt == "2+2= Go."
    pytest.importorskip("reasoning_gym")
    gym = {"type": "reasoning_gym", "size": 3, "tasks": [{"name": "chain_sum", "weight": 1.0}]}
    bare = load_problems(DatasetConfig(**gym), seed=1)
    with_it = load_problems(DatasetConfig(**gym, instruction="Go."), seed=1)
    assert [p.prompt for p in with_it] == [f"{p.prompt} Go." for p in bare]
