"""Rollout workflows: episodes, the loss mask from the episode to the loss, the multi-turn math workflow.

Expected values are hand-computed: a masked token changes no sum, count or statistic."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_async.config import ActorConfig, NormConfig, RejectionSamplingConfig
from areal_async.rollout.service import episode_batch
from areal_async.trainer.algo.advantages import compute_advantages
from areal_async.trainer.compute.dp import decode_batch, encode_batch
from areal_async.trainer.algo.loss import count_kept_tokens, policy_loss
from protocols.trajectories import Trajectory
from protocols.trajectories import TrajectoryBatch
from areal_async.workflows.base import EngineHandle, EpisodeBuilder, Generation, Prompt, Sampling
from areal_async.workflows.multi_turn_math import MultiTurnMath


class CharTok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Scripted(EngineHandle):
    """Answers from a script, version 3 on every token; reward 1 iff the answer is '7'."""

    def __init__(self, answers):
        self.tokenizer, self.answers, self.inputs = CharTok(), list(answers), []

    async def generate(self, input_ids, sampling):
        self.inputs.append(list(input_ids))
        text = self.answers.pop(0)
        return Generation([ord(c) for c in text], [-0.5] * len(text), [3] * len(text), "stop")

    async def reward(self, completion, solutions):
        return float(completion in solutions)


PROMPT = Prompt("p0", [ord(c) for c in "3+4="], ["7"], Sampling(max_new_tokens=4))
RETRY = [ord(c) for c in MultiTurnMath.feedback] + PROMPT.prompt_ids


def test_multi_turn_math_second_turn_right_scores_the_discount_and_masks_the_feedback():
    eng = Scripted(["5", "7"])
    ep = asyncio.run(MultiTurnMath().arun_episode(eng, PROMPT))
    assert ep.problem() is None and ep.turns == 2 and ep.reward == 0.5
    assert ep.output_ids == [ord("5")] + RETRY + [ord("7")]
    assert ep.loss_mask == [1] + [0] * len(RETRY) + [1]
    assert ep.versions == [3] + [-1] * len(RETRY) + [3] and ep.model_versions == [3, 3]
    assert eng.inputs[1] == PROMPT.prompt_ids + [ord("5")] + RETRY  # turn 2 sees turn 1 and the feedback


def test_multi_turn_math_first_turn_right_and_all_wrong():
    first = asyncio.run(MultiTurnMath().arun_episode(Scripted(["7"]), PROMPT))
    assert (first.turns, first.reward, first.loss_mask) == (1, 1.0, [1])
    wrong = asyncio.run(MultiTurnMath().arun_episode(Scripted(["1", "2"]), PROMPT))
    assert (wrong.turns, wrong.reward, sum(wrong.loss_mask)) == (2, 0.0, 2)


def test_episode_problems_are_named():
    b = EpisodeBuilder([1, 2])
    b.add_env([5, 6])
    assert "no 1" in b.finish(0.0).problem()
    b.add_generation(Generation([7], [-1.0], [0], "stop"))
    ep = b.finish(2.0)
    assert "reward=2.0" in ep.problem()
    ep.reward, ep.loss_mask = 1.0, [0, 0]
    assert "loss_mask has 2 entries, expected one per output token (3)" in ep.problem()


def test_the_mask_travels_as_a_tensor_and_between_trainer_ranks():
    b = EpisodeBuilder([1, 2])
    b.add_generation(Generation([7, 8], [-1.0, -2.0], [4, 5], "stop"))
    b.add_env([9])
    b.add_generation(Generation([10], [-3.0], [5], "stop"))
    one = b.finish(1.0)
    b2 = EpisodeBuilder([1, 2])
    b2.add_generation(Generation([11], [-0.5], [6], "stop"))
    key, t, meta = episode_batch("g", ["s0", "s1"], [one, b2.finish(0.0)]).encode()
    assert meta["lengths"] == [4, 1] and t["loss_mask"].tolist() == [1, 1, 0, 1, 1]
    assert t["loss_mask"].dtype == torch.bool
    s0, _ = TrajectoryBatch.decode(key, meta, t).samples()
    traj = s0.scored(1.0)
    assert traj.loss_mask.tolist() == [True, True, False, True] and traj.versions.tolist() == [4, 5, -1, 5]
    assert traj.min_version == 4  # the environment token's -1 is no version
    plain = Trajectory("p", "g", [1], [3, 4], [-1.0, -1.0], [2, 2], 0.0)
    back = decode_batch(encode_batch([traj, plain]))
    assert back[0].loss_mask.tolist() == [True, True, False, True]
    assert back[1].loss_mask.tolist() == [True, True]  # filled in for the broadcast: all trained
    with pytest.raises(ValueError, match="len\\(loss_mask\\)=1, expected len\\(output_ids\\)=2"):
        Trajectory("x", "g", [1], [3, 4], [-1.0, -1.0], [2, 2], 0.0, loss_mask=[1])


def _cfg(**kw) -> ActorConfig:
    return ActorConfig(
        use_decoupled_loss=False,
        recompute_logprob=True,
        eps_clip=0.2,
        rejection_sampling=RejectionSamplingConfig(metric="none"),
        **kw,
    )


def test_policy_loss_ignores_masked_tokens_by_hand():
    # logp == old: ratio 1, token loss = -A. Unmasked: -(1 + 5 + 3) / 3 = -3; masked [1, 0, 1]: -(1 + 3) / 2 = -2
    logp = torch.tensor([-1.0, -2.0, -0.5])
    adv = torch.tensor([1.0, 5.0, 3.0])
    behav = torch.tensor([-1.0, 0.0, -0.5])  # the environment token's behaviour logprob is 0 by convention
    cfg = _cfg()
    full, _ = policy_loss(logp, logp.clone(), behav, adv, cfg)
    masked, stats = policy_loss(logp, logp.clone(), behav, adv, cfg, loss_mask=torch.tensor([True, False, True]))
    assert float(full) == pytest.approx(-3.0) and float(masked) == pytest.approx(-2.0)
    assert stats.n_tokens == 2 and stats.n_loss_tokens == 2 and stats.n_rejected == 0
    assert count_kept_tokens(logp, behav, cfg, torch.tensor([True, False, True])) == 2


def test_advantage_norm_pools_only_trained_tokens_by_hand():
    # discount = gae_lambda = 1: every output token of a sequence carries its (group-normed) reward.
    cfg = _cfg(
        reward_norm=NormConfig("none", "none"),
        adv_norm=NormConfig("batch", "none"),
        reward_scaling=1.0,
        reward_bias=0.0,
        discount=1.0,
        gae_lambda=1.0,
    )
    a = Trajectory("a", "g", [1], [5, 6, 7], [0.0] * 3, [0, -1, 0], 1.0, loss_mask=[1, 0, 1])
    b = Trajectory("b", "g", [1], [5], [0.0], [0], 0.0)
    adv = compute_advantages([a, b], cfg)
    # trained tokens: 1, 1 (a) and 0 (b): batch mean 2/3. a -> 1/3 on trained tokens, 0 on the masked one
    assert adv[0].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3]) and adv[1].tolist() == pytest.approx([-2 / 3])


def test_calculator_tool_call_result_is_masked_and_the_answer_after_it_scores():
    from areal_async.workflows.calculator import CalculatorTool, calculate

    eng = Scripted(["<<3+4=", "\\boxed{7}"])
    eng.reward = lambda completion, solutions: _async(float("\\boxed{7}" in completion))
    ep = asyncio.run(CalculatorTool().arun_episode(eng, PROMPT))
    tool = [ord(c) for c in "7>>"]
    assert ep.turns == 2 and ep.reward == 1.0
    assert ep.output_ids == [ord(c) for c in "<<3+4="] + tool + [ord(c) for c in "\\boxed{7}"]
    assert ep.loss_mask == [1] * 6 + [0] * 3 + [1] * 9
    no_call = asyncio.run(CalculatorTool().arun_episode(Scripted(["7"]), PROMPT))
    assert (no_call.turns, no_call.reward, no_call.loss_mask) == (1, 1.0, [1])
    assert [calculate(e) for e in ("12*(3-5)", "2**8", "__import__('os')", "1+")] == ["-24", "?", "?", "?"]


async def _async(value):
    return value
