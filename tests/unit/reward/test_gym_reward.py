"""reasoning-gym's scorers as a reward plug-in, run the way the reward workers run them: in a real
``RewardPool`` (killable child processes, msgpack frames), on hand-picked completions.

The expected scores are the task's own rules applied by hand: chain_sum's answer is the value of the
expression (computed here with eval), spell_backward's the word reversed (computed here with [::-1]; it gives
partial credit per letter in its place, so its wrong answer here has none).
"""

from __future__ import annotations

import pytest

from areal_async.reward.answers import final_answer
from areal_async.reward.pool import RewardPool

rg = pytest.importorskip("reasoning_gym")  # the 'gym' extra (scripts/setup.sh installs it)
from areal_async.reward.gym_reward import GYM_REWARD_FN, decode_entry, encode_entry, gym_reward  # noqa: E402


def entry(task: str, **config) -> dict:
    return rg.create_dataset(task, seed=11, size=1, **config)[0]


@pytest.fixture(scope="module")
def pool():
    # one child: it imports reasoning-gym at its start (~3 s, matplotlib and sympy), the checks are then ms
    with RewardPool(GYM_REWARD_FN, n_procs=1, timeout_s=10.0) as p:
        yield p


def test_final_answer_takes_the_last_answer_tag_else_the_last_box():
    assert final_answer("<answer>3</answer> then <answer> 12 </answer>") == "12"
    assert final_answer("so \\boxed{7}") == "7"
    assert final_answer("<answer>5</answer> \\boxed{6}") == "5"  # reasoning-gym's tag wins over a box
    assert (
        final_answer("7") is None and final_answer("\\boxed{7") is None and final_answer("<answer> </answer>") is None
    )


def test_the_entry_round_trips_and_a_corrupt_solution_is_named():
    e = entry("chain_sum")
    task, back = decode_entry(encode_entry("chain_sum", e))
    assert task == "chain_sum" and back["answer"] == e["answer"]
    with pytest.raises(ValueError, match="is not a reasoning-gym entry"):
        decode_entry('{"answer": "3"}')
    with pytest.raises(ValueError, match="is not a reasoning-gym entry"):
        gym_reward("\\boxed{3}", ["3"])  # a math dataset's bare answer


async def test_right_wrong_and_malformed_answers_in_the_reward_pool(pool):
    cs = entry("chain_sum", min_terms=3, max_terms=3, min_digits=2, max_digits=2)
    value = eval(cs["metadata"]["expression"])  # the expression's own value, independent of the scorer
    sb = entry("spell_backward", min_word_len=5, max_word_len=5)
    word = sb["question"].rsplit(": ", 1)[1].strip()
    cs_sol, sb_sol = [encode_entry("chain_sum", cs)], [encode_entry("spell_backward", sb)]
    cases = [
        (f"thinking... \\boxed{{{value}}}", cs_sol, 1.0, "ok"),  # right, boxed
        (f"<answer>{value}</answer>", cs_sol, 1.0, "ok"),  # right, reasoning-gym's tag
        (f"\\boxed{{{value + 1}}}", cs_sol, 0.0, "ok"),  # wrong
        (str(value), cs_sol, 0.0, "ok"),  # malformed: the answer is not stated in a box or tag
        (f"\\boxed{{{value}", cs_sol, 0.0, "ok"),  # malformed: a truncated box
        (f"<answer>{word[::-1]}</answer>", sb_sol, 1.0, "ok"),  # right: the word reversed
        ("<answer>" + "#" * len(word) + "</answer>", sb_sol, 0.0, "ok"),  # wrong: no letter in its place
        ("\\boxed{3}", ['{"not": "an entry"}'], 0.0, "error"),  # a corrupt solution: an error, named
    ]
    outs = await pool.score_many([(c, s) for c, s, _, _ in cases])
    for (completion, _, score, status), out in zip(cases, outs):
        assert (out.score, out.status) == (score, status), (completion, out)
    assert "is not a reasoning-gym entry" in outs[-1].detail


async def test_gym_plain_reward_in_the_reward_pool():
    e = rg.create_dataset("basic_arithmetic", seed=5, size=1, min_terms=3, max_terms=3, operators=("+", "-", "*"))[0]
    value = eval(e["metadata"]["expression"])  # the expression's own value, independent of the scorer
    sol = [encode_entry("basic_arithmetic", e)]
    cases = [
        (f"The answer is {value}.", sol, 1.0, "ok"),  # stated in a sentence, not boxed
        (f"{value} + 1 = {value + 1}", sol, 0.0, "ok"),  # the last number is wrong
        ("I do not know.", sol, 0.0, "ok"),
        ("7", ["7"], 0.0, "error"),  # a plain answer where an entry belongs: an error, named
    ]
    with RewardPool("areal_async.reward.gym_reward:gym_plain_reward", n_procs=1, timeout_s=10.0) as pool:
        outs = await pool.score_many([(c, s) for c, s, _, _ in cases])
    for (completion, _, score, status), out in zip(cases, outs):
        assert (out.score, out.status) == (score, status), (completion, out)
    assert "is not a reasoning-gym entry" in outs[-1].detail
