"""The top_p ratio question (trl #6789) on the embedded engine and the trainer.

Under top_p < 1 a token is drawn from the nucleus renormalised, mu(a) = pi_T(a) / S, where pi_T =
softmax(logits / T) and S is the nucleus mass. TRL's bias: vLLM returned log mu while its trainer
recomputed log pi_T, so the decoupled weight exp(prox - behav) was S, not 1, at the same weights.

Here, computed by hand in float64 from the model's own logits: the engine reports log pi_T (the full
distribution at the sampling temperature, not log mu); the trainer's proximal recompute is log pi_T too;
so at the first step (same weights) exp(prox - behav) is 1 for every token to float32 noise (~1e-6),
and the trainer's behav_approx_kl sees no bias. Had the engine reported log mu, each token's weight
would be S (behav_approx_kl = mean (log S)^2 / 2), which the same check would catch.
"""

import copy
import math

import pytest
import torch

from areal_async.config import ActorConfig, ModelConfig
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.trainer.actor import PPOActor
from protocols.trajectories import Trajectory

TOK = build_char_tokenizer()
CFG = ModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
T, TOP_P = 0.7, 0.8


def by_hand(model64, prompt, out):
    """Per output token, float64: (log pi_T(token), log S) with S the nucleus mass: tokens taken in
    decreasing probability while the mass before them is < TOP_P (the first one always)."""
    ids = torch.tensor([list(prompt) + list(out)])
    with torch.no_grad():
        logits = model64(ids).logits[0, len(prompt) - 1 : -1].double() / T
    full, log_s = [], []
    for row, tok in zip(logits.tolist(), out):
        z = max(row)
        total = sum(math.exp(x - z) for x in row)
        probs = sorted((math.exp(x - z) / total for x in row), reverse=True)
        nucleus = []
        for p in probs:
            if sum(nucleus) >= TOP_P:
                break
            nucleus.append(p)
        p_tok = math.exp(row[tok] - z) / total
        assert p_tok >= nucleus[-1], "a token outside the nucleus was sampled"
        full.append(math.log(p_tok))
        log_s.append(math.log(sum(nucleus)))
    return full, log_s


@pytest.fixture(scope="module")
def sampled():
    model = build_model(CFG, len(TOK), seed=0)
    engine = TorchEngine(copy.deepcopy(model), TOK, seed=3, version=0)
    prompts = {f"g{i}": TOK.encode(p) for i, p in enumerate(["7+5=", "1", "what is 12+30? "])}
    for gid, ids in prompts.items():
        engine.add_request(GenRequest(gid, ids, n=4, max_new_tokens=10, temperature=T, top_p=TOP_P))
    trajs = []
    while engine.has_work():
        for o in engine.step():
            for j, s in enumerate(o.samples()):
                ids = prompts[o.group_id]
                trajs.append(
                    Trajectory(f"{o.group_id}.{j}", o.group_id, ids, s.output_ids, s.logprobs, s.versions, j % 2)
                )
    model64 = copy.deepcopy(model).double()
    hand = [by_hand(model64, t.prompt_ids.tolist(), t.output_ids.tolist()) for t in trajs]
    full = torch.tensor([x for f, _ in hand for x in f], dtype=torch.float64)
    log_s = torch.tensor([x for _, s in hand for x in s], dtype=torch.float64)
    return model, trajs, full, log_s


def test_the_engine_reports_the_full_distribution_at_the_temperature_not_the_nucleus(sampled):
    _, trajs, full, log_s = sampled
    behav = torch.cat([t.logprobs for t in trajs]).double()
    assert (behav - full).abs().max() < 1e-5  # log pi_T(a)
    # the nucleus was real: most tokens' S < 1, and log mu = log pi_T - log S is far from what was reported
    assert (log_s < -1e-3).float().mean() > 0.9 and (behav - (full - log_s)).abs().mean() > 0.1


def test_the_trainer_recomputes_the_same_so_the_first_step_ratio_is_one(sampled):
    model, trajs, full, log_s = sampled
    actor = PPOActor(copy.deepcopy(model), ActorConfig(use_decoupled_loss=True, recompute_logprob=True), T, 1)
    prox = actor._output_logprobs(actor.model, actor._prepare(trajs)).double()
    behav = torch.cat([t.logprobs for t in trajs]).double()
    assert (prox - full).abs().max() < 1e-5
    ratio = torch.exp(prox - behav)
    assert (ratio - 1).abs().max() < 1e-5, f"max |w - 1| = {(ratio - 1).abs().max():.2e}"
    # had the engine reported log mu (TRL's case), every weight would be S: off by top_p's order, not noise
    assert (torch.exp(prox - (full - log_s)) - torch.exp(log_s)).abs().max() < 1e-5
    assert torch.exp(log_s).mean() < 0.95


@pytest.mark.parametrize("report", ["engine", "nucleus"])
def test_the_loss_sees_no_behaviour_gap_at_the_first_step(sampled, report):
    """The trainer's own column: behav_approx_kl = mean (prox - behav)^2 / 2 over the step's tokens."""
    model, trajs, full, log_s = sampled
    if report == "nucleus":  # what a backend returning log mu would send
        cuts = torch.cumsum(torch.tensor([0] + [len(t.output_ids) for t in trajs]), 0).tolist()
        mu = (full - log_s).float()
        trajs = [
            Trajectory(t.sample_id, t.group_id, t.prompt_ids, t.output_ids, mu[a:b], t.versions, t.score)
            for t, a, b in zip(trajs, cuts, cuts[1:])
        ]
    actor = PPOActor(copy.deepcopy(model), ActorConfig(use_decoupled_loss=True, recompute_logprob=True), T, 1)
    m = actor.train_step(trajs)
    want = 0.0 if report == "engine" else float((log_s**2).mean() / 2)
    assert m["behav_approx_kl"] == pytest.approx(want, abs=1e-9, rel=1e-4)


def test_the_vllm_backend_refuses_the_combination_whose_logprobs_are_the_nucleus():
    """vLLM's processed logprobs (its only mode that applies a temperature != 1) are log mu
    (tests/contract/test_vllm_top_p.py measures it); the trainer recomputes log pi_T: refused."""
    from areal_async.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="gconfig.top_p=0.9: expected 1.0 with rollout.backend=vllm at gconfig.temp"):
        from_dict({"rollout": {"backend": "vllm"}, "gconfig": {"temperature": 0.7, "top_p": 0.9}})
    for ok in ({"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7, "top_p": 1.0}):  # raw mode / no nucleus
        assert from_dict({"rollout": {"backend": "vllm"}, "gconfig": ok}).gconfig.top_p == ok["top_p"]
    assert from_dict({"gconfig": {"temperature": 0.7, "top_p": 0.9}}).gconfig.top_p == 0.9  # the torch engine: log pi_T
