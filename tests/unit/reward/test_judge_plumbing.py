"""reward.judge's plumbing without a model: the verdict parser, the judge's prompt (the question in it), a
batch-aware function in the real pool (one call a frame, errors per check, the frame killed at its deadline,
the questions passed through the pool and the reward worker behind real sockets), and the config's choice of
fn. The judge on a real model against a reference implementation: tests/contract/test_reward_judge.py."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.sockets import ipc_endpoint, make_socket, send_message

from areal_async.base.control import ControlClient
from areal_async.config.sections import RewardConfig
from areal_async.config.base import ConfigError
from areal_async.reward.judge import (
    JUDGE_FN,
    NoQuestion,
    NoVerdict,
    judge_kwargs,
    parse_verdict,
    prompt_text,
    reference_text,
)
from areal_async.reward.pool import RewardPool
from areal_async.reward.service import RewardService
from tests.unit.reward.test_reward_service import next_of


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


def test_the_judges_prompt_holds_the_question_and_refuses_a_check_without_one():
    template = RewardConfig().judge_template
    text = prompt_text(object(), template, " 3 + 4 = 7 ", ["7", "7.0"], "3+4=")  # no chat template: the body
    assert text == (
        "Question: 3+4=\nReference answer: 7\nStudent answer: 3 + 4 = 7\n"
        "Does the student answer give the same final result as the reference answer? Answer yes or no."
    )
    with pytest.raises(NoQuestion, match="reads {question} but this check carried no question"):
        prompt_text(object(), template, "7", ["7"], "")
    assert prompt_text(object(), "{completion} vs {solution}", "7", ["8"]) == "7 vs 8"  # a template without it


def test_the_judge_reads_a_gym_entrys_answer_and_a_plain_prompt_when_asked():
    entry = '{"task": "basic_arithmetic", "answer": "-6", "metadata": {"expression": "2 - 8"}}'
    assert reference_text(entry) == "-6" and reference_text("7") == "7" and reference_text('{"a": 1}') == '{"a": 1}'

    class Chat:  # a tokenizer with a chat template: used unless chat=False
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            return "<user>" + msgs[0]["content"] + "<assistant>"

    tpl = "Q: {question}\nS: {completion}\nA: {solution}\nRight?"
    assert prompt_text(Chat(), tpl, "2 - 8 = -6", [entry], "Calculate 2 - 8.") == (
        "<user>Q: Calculate 2 - 8.\nS: 2 - 8 = -6\nA: -6\nRight?<assistant>"
    )
    assert prompt_text(Chat(), tpl, "2 - 8 = 6", [entry], "Calculate 2 - 8.", chat=False) == (
        "Q: Calculate 2 - 8.\nS: 2 - 8 = 6\nA: -6\nRight?"
    )
    kw = judge_kwargs(RewardConfig(judge="/m", judge_verdict="prob", judge_chat=False))
    assert (kw["verdict"], kw["chat"]) == ("prob", False)
    with pytest.raises(ConfigError, match="judge_verdict"):
        RewardConfig(judge="/m", judge_verdict="score")


def test_the_pool_passes_questions_to_a_batch_fn_and_never_to_a_plain_one():
    items = [("7", ["0"], "3+4="), ("8", ["0"], "3+4="), ("12", ["0"], "5+7="), ("9", ["0"], "5+4=")]
    with RewardPool("tests.support.reward_fixtures:sum_judge", n_procs=2, timeout_s=20) as pool:
        outs = asyncio.run(pool.score_many(items))
        assert [(o.score, o.status) for o in outs] == [(1.0, "ok"), (0.0, "ok"), (1.0, "ok"), (1.0, "ok")]
        bare = pool.score_sync("7", ["7"])
        assert bare.status == "error" and "no question came with the check" in bare.detail
        with pytest.raises(TypeError, match="all of them"):
            asyncio.run(pool.score_many([("7", ["7"], "3+4="), ("7", ["7"])]))
    with RewardPool(n_procs=1, timeout_s=20) as pool:  # math-verify: (completion, solutions) only
        outs = asyncio.run(pool.score_many([("\\boxed{7}", ["7"], "3+4="), ("\\boxed{8}", ["7"], "3+4=")]))
    assert [o.score for o in outs] == [1.0, 0.0]


async def test_the_reward_worker_gives_each_check_its_groups_question(tmp_path):
    ctx = zmq.asyncio.Context()
    control_ep, work_ep = ipc_endpoint(tmp_path, "control"), ipc_endpoint(tmp_path, "work")
    scheduler = make_socket(ctx, zmq.ROUTER, bind=control_ep)
    pool = RewardPool("tests.support.reward_fixtures:sum_judge", n_procs=2, timeout_s=20.0)
    control = ControlClient(ctx, control_ep, "reward", "reward-0", heartbeat_s=0.2)
    task = asyncio.create_task(RewardService("reward-0", control, ctx, work_ep, pool, n_procs=2).run())
    push = make_socket(ctx, zmq.PUSH, connect=work_ep)
    ident = None
    try:
        ident, _ = await next_of(scheduler, M.Register)
        await send_message(scheduler, M.RegisterAck(worker_id="reward-0", version=0), to=ident)
        many = M.Batch.of(  # the solutions say nothing: only the question tells right from wrong
            [
                M.RewardRequest("g1", ["g1.0", "g1.1", "g1.2"], ["7", "8", " 7"], ["?"], prompt="3+4="),
                M.RewardRequest("g2", ["g2.0", "g2.1"], ["11", "10"], ["?"], prompt="9+2="),
            ]
        )
        assert many.columns["prompt"] == ["3+4=", "9+2="]
        await send_message(push, many)
        got = {}
        while len(got) < 2:
            _, batch = await next_of(scheduler, M.Batch)
            got.update({r.group_id: (r.scores, r.statuses) for r in batch.items()})
        assert got == {"g1": ([1.0, 0.0, 1.0], ["ok"] * 3), "g2": ([1.0, 0.0], ["ok"] * 2)}
        await send_message(push, M.RewardRequest("g3", ["g3.0"], ["7"], ["7"]))  # no question sent
        _, batch = await next_of(scheduler, M.Batch)
        ((res),) = batch.items()
        assert res.statuses == ["error"] and "no question" in res.details[0]
    finally:
        if ident is not None:
            await send_message(scheduler, M.Shutdown(reason="test"), to=ident)
        assert await asyncio.wait_for(task, 10) == 0
        ctx.destroy(linger=0)
