"""PPO losses: ratios, clipping, decoupled importance weights, rejection, token-level normalization."""

import math

import pytest
import torch

from areal_async.config import ActorConfig, RejectionSamplingConfig
from areal_async.trainer.algo.loss import behav_importance, clipped_surrogate, count_kept_tokens, policy_loss

L15, L05 = math.log(1.5), math.log(0.5)


def test_clipped_surrogate_by_hand():
    # ratios 1, 1.5, 0.5 with eps 0.2
    logp = torch.tensor([0.0, L15, L05])
    tok, clipped = clipped_surrogate(logp, torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), 0.2)
    # A=1, r=1: -1. A=1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped). A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert tok.tolist() == pytest.approx([-1.0, -1.2, 0.8], abs=1e-6)
    assert clipped.tolist() == [False, True, True]
    # A=1, r=0.5 and A=-1, r=1.5: unclipped branch is larger -> no clipping
    tok, clipped = clipped_surrogate(torch.tensor([L05, L15]), torch.zeros(2), torch.tensor([1.0, -1.0]), 0.2)
    assert tok.tolist() == pytest.approx([-0.5, 1.5], abs=1e-6) and clipped.tolist() == [False, False]


def test_plain_ppo_uses_behaviour_or_proximal_as_old():
    logp = torch.tensor([L15, 0.0])
    behav = torch.tensor([0.0, 0.0])
    prox = torch.tensor([L15, L15])
    adv = torch.tensor([1.0, 1.0])
    loss, s = policy_loss(logp, prox, behav, adv, ActorConfig(eps_clip=0.2))  # old = behaviour
    assert float(loss) == pytest.approx((-1.2 + -1.0) / 2, abs=1e-6) and s.n_clipped == 1
    loss, _ = policy_loss(logp, prox, behav, adv, ActorConfig(eps_clip=0.2, recompute_logprob=True))  # old = prox
    # token 2: r = 1/1.5 < 0.8 with A > 0: max(-0.667, -0.8) = -0.667, the unclipped branch
    assert float(loss) == pytest.approx((-1.0 - 1 / 1.5) / 2, abs=1e-6)


def decoupled_cfg(mode="mask", upper=5.0, eps=0.2):
    return ActorConfig(
        eps_clip=eps,
        use_decoupled_loss=True,
        recompute_logprob=True,
        rejection_sampling=RejectionSamplingConfig("ratio", upper, mode),
    )


def test_behaviour_weights_mask_and_clamp():
    prox = torch.tensor([0.0, math.log(2.0), math.log(6.0), math.log(5.0)])
    behav = torch.zeros(4)
    w, keep = behav_importance(prox, behav, RejectionSamplingConfig("ratio", 5.0, "mask"))
    assert w.tolist() == pytest.approx([1.0, 2.0, 6.0, 5.0], abs=1e-6) and keep.tolist() == [True, True, False, True]
    w, keep = behav_importance(prox, behav, RejectionSamplingConfig("ratio", 5.0, "clamp"))
    assert w.tolist() == pytest.approx([1.0, 2.0, 5.0, 5.0], abs=1e-6) and keep.all()
    w, keep = behav_importance(prox, behav, RejectionSamplingConfig("none", 5.0, "mask"))
    assert keep.all() and w.tolist() == pytest.approx([1.0, 2.0, 6.0, 5.0], abs=1e-6)


def test_decoupled_loss_by_hand():
    # token: ratio r = exp(logp - prox), weight w = exp(prox - behav), adv
    r = [1.0, 1.5, 0.5, 1.1]
    w = [1.0, 2.0, 8.0, 0.5]
    adv = [1.0, 1.0, -1.0, -2.0]
    prox = torch.tensor([0.1, -0.3, -1.0, -2.0])
    logp = prox + torch.log(torch.tensor(r))
    behav = prox - torch.log(torch.tensor(w))
    per_tok = []
    for ri, ai in zip(r, adv):
        per_tok.append(max(-ai * ri, -ai * min(max(ri, 0.8), 1.2)))
    # mask: token 2 (w=8 > 5) leaves the loss but stays in the count (AReaL's ppo_actor_loss_fn)
    want_mask = sum(per_tok[i] * w[i] for i in (0, 1, 3)) / 4
    loss, s = policy_loss(logp, prox, behav, torch.tensor(adv), decoupled_cfg("mask"))
    assert float(loss) == pytest.approx(want_mask, abs=1e-6)
    assert s.n_loss_tokens == 3 and s.n_rejected == 1 and s.as_dict()["rejected_frac"] == pytest.approx(0.25)
    assert s.iw_max == pytest.approx(8.0, abs=1e-5)
    assert s.as_dict()["imp_weight_mean"] == pytest.approx(11.5 / 4, abs=1e-5)
    assert s.n_clipped == 1  # token 1 (r=1.5, A>0); token 2 would be but is rejected
    # clamp: all 4 tokens, token 2 weighted 5
    want_clamp = (per_tok[0] * 1 + per_tok[1] * 2 + per_tok[2] * 5 + per_tok[3] * 0.5) / 4
    loss, s = policy_loss(logp, prox, behav, torch.tensor(adv), decoupled_cfg("clamp"))
    assert float(loss) == pytest.approx(want_clamp, abs=1e-6) and s.n_rejected == 0
    assert count_kept_tokens(prox, behav, decoupled_cfg("mask")) == 3


def test_global_token_count_and_entropy_bonus():
    logp = torch.zeros(2)
    adv = torch.tensor([1.0, 3.0])
    cfg = ActorConfig(entropy_coef=0.5)
    loss, s = policy_loss(logp, None, torch.zeros(2), adv, cfg, n_tokens=8, entropy=torch.tensor([2.0, 4.0]))
    assert float(loss) == pytest.approx((-1 - 3) / 8 - 0.5 * (2 + 4) / 8, abs=1e-6)
    assert s.as_dict()["entropy"] == pytest.approx(3.0)


def test_token_level_normalization_weighs_long_sequences_by_length():
    """A 100-token and a 10-token sequence with equal advantages: every token gets the same
    gradient, so the long sequence's total gradient is 10x (a per-sequence mean would give 1x)."""
    logp = torch.zeros(110, requires_grad=True)
    adv = torch.ones(110)
    loss, _ = policy_loss(logp, None, torch.zeros(110), adv, ActorConfig())
    loss.backward()
    g = logp.grad.abs()
    assert float(g[:100].sum()) == pytest.approx(10 * float(g[100:].sum()), rel=1e-6)
    assert float(g[0]) == pytest.approx(1 / 110, abs=1e-9)
    # contribution to the loss value: 100/110 vs 10/110
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-6)


def test_micro_batch_split_equals_whole_batch():
    torch.manual_seed(0)
    logp, prox, behav, adv = (torch.randn(12) * 0.3 for _ in range(4))
    cfg = decoupled_cfg("mask", upper=1.3)
    whole, s_whole = policy_loss(logp, prox, behav, adv, cfg)
    n = 12  # every token, rejected ones included
    a, s_a = policy_loss(logp[:5], prox[:5], behav[:5], adv[:5], cfg, n_tokens=n)
    b, s_b = policy_loss(logp[5:], prox[5:], behav[5:], adv[5:], cfg, n_tokens=n)
    assert float(a + b) == pytest.approx(float(whole), abs=1e-6)
    merged = s_a.merge(s_b).as_dict()
    for k in ("clip_frac", "imp_weight_mean", "imp_weight_max", "rejected_frac", "approx_kl", "behav_approx_kl"):
        assert merged[k] == pytest.approx(s_whole.as_dict()[k], abs=1e-6)
    expected = float((0.5 * (prox - behav) ** 2).mean())  # over every token, rejected ones included
    assert s_whole.as_dict()["behav_approx_kl"] == pytest.approx(expected, rel=1e-6) and expected > 0


def test_rejected_tokens_stay_in_the_denominator_reference():
    """Hand-computed reference: 4 tokens, prox = logp (ratio 1, no clipping), advantages 1, 2, 3, 4,
    behaviour weights 1, 1, 10, 1 with upper 5. Token 3 is rejected: its loss is zeroed but the
    denominator stays 4, so loss = -(1 + 2 + 4) / 4 = -1.75 (dividing by the 3 survivors would
    give -2.333..., up-weighting them as the batch gets staler) and each survivor's gradient
    w.r.t. its logp is -A_i / 4."""
    prox = torch.tensor([-1.0, -0.5, -2.0, -0.25])
    logp = prox.clone().requires_grad_(True)
    behav = prox - torch.log(torch.tensor([1.0, 1.0, 10.0, 1.0]))
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0])
    loss, s = policy_loss(logp, prox, behav, adv, decoupled_cfg("mask", upper=5.0))
    assert float(loss.detach()) == pytest.approx(-1.75, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.25, -0.5, 0.0, -1.0], abs=1e-6)
    assert s.n_rejected == 1 and s.n_tokens == 4 and s.n_loss_tokens == 3
    # split over two micro-batches with the global count 4: the same gradient
    g = torch.zeros(4)
    for sl in (slice(0, 3), slice(3, 4)):
        part = prox[sl].clone().requires_grad_(True)
        policy_loss(part, prox[sl], behav[sl], adv[sl], decoupled_cfg("mask"), n_tokens=4)[0].backward()
        g[sl] = part.grad
    assert g.tolist() == pytest.approx([-0.25, -0.5, 0.0, -1.0], abs=1e-6)
