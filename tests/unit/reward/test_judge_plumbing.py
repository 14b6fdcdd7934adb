"""reward.judge's plumbing without a model: the verdict parser, a batch-aware function in the real pool
(one call a frame, errors per check, the frame killed at its deadline), and the config's choice of fn.
The judge on a real model against a reference implementation: tests/contract/test_reward_judge.py."""

from __future__ import annotations

import pytest

from areal_async.config.sections import RewardConfig
from areal_async.reward.judge import JUDGE_FN, NoVerdict, judge_kwargs, parse_verdict
from areal_async.reward.pool import RewardPool


@pytest.mark.parametrize(
    "text,score",
    [("Yes", 1.0), (" no.", 0.0), ("NO, it is 8", 0.0), ("yes and no", 1.0), ("Answer: YES", 1.0), ("\nno", 0.0)],
)
def test_the_first_whole_yes_or_no_is_the_verdict(text, score):
    assert parse_verdict(text) == score


@pytest.mark.parametrize("text", ["", "Maybe", "yesterday", "nobody knows", "Y"])
def test_no_verdict_is_an_error_not_a_zero(text):
    with pytest.raises(NoVerdict, match="no yes/no verdict"):
        parse_verdict(text)


def test_a_batch_fn_is_called_once_a_frame_with_errors_per_check(tmp_path):
    log = tmp_path / "frames.txt"
    sols = [str(log)]
    items = [("abcd", sols), ("raise", sols), ("ab", sols), ("abcdefgh", sols), ("x", sols)]
    with RewardPool("tests.support.reward_fixtures:batched_length", n_procs=2, timeout_s=20) as pool:
        import asyncio

        outs = asyncio.run(pool.score_many(items))
    assert [o.status for o in outs] == ["ok", "error", "ok", "ok", "ok"]
    assert [o.score for o in outs] == [0.4, 0.0, 0.2, 0.8, 0.1]
    assert "no verdict" in outs[1].detail
    frames = sorted(int(line.split()[1]) for line in log.read_text().splitlines())
    assert frames == [2, 3]  # round-robin shares of 3 and 2 checks, one call each


def test_a_hung_batch_is_killed_at_the_timeout(tmp_path):
    sols = [str(tmp_path / "f.txt")]
    with RewardPool("tests.support.reward_fixtures:batched_length", n_procs=1, timeout_s=1.0) as pool:
        out = pool.score_sync("hang", sols)
    assert out.status == "timeout" and out.score == 0.0


def test_judge_replaces_fn_in_the_pool_config():
    assert judge_kwargs(RewardConfig()) is None
    cfg = RewardConfig(judge="/m", judge_max_new_tokens=3)
    kw = judge_kwargs(cfg)
    assert kw["model"] == "/m" and kw["max_new_tokens"] == 3 and "{completion}" in kw["template"]
    assert JUDGE_FN == "areal_async.reward.judge:judge"
    with pytest.raises(ValueError, match="judge_template"):
        RewardConfig(judge="/m", judge_template="no slot")
