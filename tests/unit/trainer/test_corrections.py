"""The off-policy corrections of issue 42, each on tiny tensors against values worked out by hand (float64).

Anchors (read, not run; the hand arithmetic in each test is the reference):
- IcePop (Ling team, "Every Step Evolves", arXiv 2510.18855): the token weight k = pi_train / pi_infer is
  kept where alpha <= k <= beta (alpha 0.5, beta 5) and zeroed elsewhere; AReaL expresses it as its
  rejection_sampling with level token, action mask and a lower bound (areal/utils/functional/functional.py
  L167-182 ``_check_bounds``, at inclusionAI/AReaL 4aef98d8).
- the geometric-mean sequence mask: verl's seq_mean_k1 (rollout_corr_helper.py L301-307 at volcengine/verl
  b178a3cd: mean over the sequence of k1 = -log r, kept inside [log lower, log upper]); with bounds
  symmetric in log space (lower = 1 / upper) that is exp(mean log r) inside [lower, upper], AReaL's sequence
  level with agg mean.
- MIS: verl's Seq-MIS (``decoupled_seq_is_rs``): the sequence weight exp(sum log r) (L537-544, the log sum
  clamped at +-20, L75), the sequence rejected outside [lower, upper] (seq_sum_k1, L282-288).
- M2PO (Zheng et al., arXiv 2510.01161; AReaL areal/trainer/ppo/actor.py L813-850 ``_get_m2po_loss_mask``):
  drop the tokens of the largest (behav - prox)^2 until the mean of the rest is below the threshold;
  the dropped tokens leave the loss mask, hence the loss's token count (L446-448).
"""

import math

import pytest
import torch

from areal_async.config import ActorConfig, ConfigError, RejectionSamplingConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.algo.corrections import m2po_keep, masked_block
from areal_async.trainer.algo.loss import behav_importance, policy_loss
from areal_async.trainer.algo.mismatch import mismatch_metrics

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def decoupled(rs: RejectionSamplingConfig, **kw) -> ActorConfig:
    return ActorConfig(use_decoupled_loss=True, recompute_logprob=True, rejection_sampling=rs, **kw)


def loss_and_grad(w, rs, seq_lens=None):
    """policy_loss at logp = prox (ratio 1, no clip), advantage 1 on every token (the weights are float32 in the
    loss, hence the 1e-6 tolerance on float64 hand values): each kept token adds
    -1 * w_t, divided by all tokens (rejected ones included); d loss / d logp_t = -w_t / N where kept."""
    prox = torch.zeros(len(w), dtype=D)
    behav = prox - torch.log(t(*w))  # w = exp(prox - behav)
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, prox, behav, torch.ones(len(w), dtype=D), decoupled(rs), seq_lens=seq_lens)
    loss.backward()
    return float(loss.detach()), logp.grad.tolist(), stats


def test_icepop_masks_tokens_outside_half_to_five_and_weights_the_rest():
    rs = RejectionSamplingConfig("ratio", 5.0, "mask", lower=0.5)
    w = [0.4, 0.5, 2.0, 5.0, 6.0]  # kept: 0.5, 2.0 and 5.0 (the bounds are inside, as IcePop's [alpha, beta])
    loss, grad, stats = loss_and_grad(w, rs)
    assert loss == pytest.approx(-(0.5 + 2.0 + 5.0) / 5, abs=1e-6)
    assert grad == pytest.approx([0.0, -0.5 / 5, -2.0 / 5, -5.0 / 5, 0.0], abs=1e-6)
    assert (stats.n_rejected, stats.n_tokens) == (2.0, 5.0)
    # without the lower bound (today's token mask, TIS-like) the 0.4 token is kept
    loss, _, _ = loss_and_grad(w, RejectionSamplingConfig("ratio", 5.0, "mask"))
    assert loss == pytest.approx(-(0.4 + 0.5 + 2.0 + 5.0) / 5, abs=1e-6)


def test_clamp_mode_clamps_into_lower_and_upper():
    rs = RejectionSamplingConfig("ratio", 5.0, "clamp", lower=0.5)
    w, keep = behav_importance(torch.log(t(0.1, 1.0, 9.0)), t(0, 0, 0), rs)  # AReaL's clamp(min=lower, max=upper)
    assert w.tolist() == pytest.approx([0.5, 1.0, 5.0], abs=1e-6) and keep.all()


def test_geometric_sequence_mask_judges_exp_mean_log_w():
    # seq 1: w = 2, 0.08 -> exp(mean log w) = sqrt(0.16) = 0.4 < 0.5: both tokens out (verl: mean k1 =
    #   -log 0.4 = 0.916 > log 2 = 0.693, the same verdict with lower = 1 / upper)
    # seq 2: w = 1.25, 0.8 -> sqrt(1.0) = 1: both kept, each weighted 1 (the sequence's weight, not its own)
    rs = RejectionSamplingConfig("ratio", 2.0, "mask", level="sequence", lower=0.5)
    loss, grad, stats = loss_and_grad([2.0, 0.08, 1.25, 0.8], rs, seq_lens=[2, 2])
    assert loss == pytest.approx(-(1.0 + 1.0) / 4, abs=1e-6)
    assert grad == pytest.approx([0.0, 0.0, -0.25, -0.25], abs=1e-6)
    assert stats.n_rejected == 2.0
    w, _ = behav_importance(torch.log(t(2.0, 0.08, 1.25, 0.8)), t(0, 0, 0, 0), rs, seq_lens=[2, 2])
    assert w.tolist() == pytest.approx([0.4, 0.4, 1.0, 1.0], rel=1e-6)


def test_mis_judges_and_weights_by_the_sequence_ratio():
    # seq 1: w = 1.5, 1.6 -> product 2.4 > 2: rejected; seq 2: w = 1.8 -> kept with weight 1.8
    rs = RejectionSamplingConfig("ratio", 2.0, "mask", level="sequence", lower=0.5, agg="sum")
    loss, grad, _ = loss_and_grad([1.5, 1.6, 1.8], rs, seq_lens=[2, 1])
    assert loss == pytest.approx(-1.8 / 3, abs=1e-6)
    assert grad == pytest.approx([0.0, 0.0, -1.8 / 3], abs=1e-6)
    # a sequence of 0.7 and 0.6: product 0.42 < 0.5, rejected though each token alone is inside the bounds
    w, keep = behav_importance(torch.log(t(0.7, 0.6)), t(0, 0), rs, seq_lens=[2])
    assert w.tolist() == pytest.approx([0.42, 0.42], rel=1e-6) and not keep.any()


def test_mis_log_sum_is_clamped_at_twenty_as_verl():
    rs = RejectionSamplingConfig("ratio", 2.0, "clamp", level="sequence", agg="sum")
    w, _ = behav_importance(t(15.0, 15.0), t(0, 0), rs, seq_lens=[2])  # log sum 30 -> 20 -> clamped to 2
    assert w.tolist() == pytest.approx([2.0, 2.0])
    w, keep = behav_importance(
        t(-15.0, -15.0),
        t(0, 0),
        RejectionSamplingConfig("ratio", 2.0, "mask", level="sequence", agg="sum"),
        seq_lens=[2],
    )
    assert w.tolist() == pytest.approx([math.exp(-20.0)] * 2, rel=1e-5) and keep.all()  # no lower bound


@pytest.mark.parametrize(
    "threshold,kept",
    [
        # m2 = 9, 1, 0.25, 0.01; suffix means (largest first dropped): 2.565, 0.42, 0.13, 0.01
        (0.5, [False, True, True, True]),  # 0.42 < 0.5 after dropping the 9
        (0.1, [False, False, False, True]),  # 0.42, 0.13 >= 0.1; 0.01 < 0.1
        (3.0, [True, True, True, True]),  # 2.565 < 3 already
        (0.001, [False, False, False, True]),  # never below: all but the smallest dropped (AReaL L841)
    ],
)
def test_m2po_drops_the_largest_second_moments_until_the_mean_is_below(threshold, kept):
    behav, prox = t(-3.0, -1.0, -1.5, -0.9), t(0.0, 0.0, -1.0, -1.0)  # behav - prox = -3, -1, -0.5, 0.1
    assert m2po_keep(behav, prox, torch.ones(4, dtype=torch.bool), threshold).tolist() == kept


def test_m2po_ignores_tokens_outside_the_mask():
    behav, prox = t(-3.0, -1.0, -1.5, -0.9, -50.0), t(0.0, 0.0, -1.0, -1.0, 0.0)
    mask = torch.tensor([True, True, True, True, False])  # the 2500 would dominate every mean
    assert m2po_keep(behav, prox, mask, 0.5).tolist() == [False, True, True, True, False]


def test_m2po_in_the_actor_takes_tokens_out_of_the_loss_and_its_count():
    from tests.unit.trainer.test_trainer_actor import boba_cfg, make_trajs, tiny_model

    model = tiny_model()
    trajs = make_trajs(model)  # on-policy: 12 output tokens, 6 in the first two trajectories
    for tr in trajs[:2]:
        tr.logprobs = tr.logprobs - 3.0  # m2 = 9 on these 6 tokens, ~0 on the other 6
    # dropping j of the 9s leaves mean 9 (6 - j) / (12 - j): < 1 only at j = 6
    m = PPOActor(model, boba_cfg(m2_threshold=1.0), 1.0, 10).train_step(trajs)
    assert (m["masked_frac_m2po"], m["masked_frac_rs"], m["masked_frac"]) == (0.5, 0.0, 0.5)
    assert m["n_loss_tokens"] == 6.0  # the loss (and its denominator) has the other six only


def test_masked_block_adds_the_two_corrections():
    assert masked_block(10.0, 2.0, 3.0) == {"masked_frac": 0.5, "masked_frac_rs": 0.2, "masked_frac_m2po": 0.3}


def test_ratio_columns_by_hand():
    prox, behav = torch.tensor([0.0, 0.5, -1.0, 0.0]), torch.zeros(4)  # w = 1, e^0.5, e^-1, 1
    m = mismatch_metrics(prox, behav, torch.zeros(4, dtype=torch.long))
    assert m["ratio_max"] == pytest.approx(1.6487212707, rel=1e-7)
    assert m["ratio_p99"] == pytest.approx(1.6487212707, rel=1e-7)  # the ceil(3.96) = 4th smallest
    assert m["ratio_p1"] == pytest.approx(0.3678794412, rel=1e-7) and m["ratio_min"] == m["ratio_p1"]
    big = mismatch_metrics(torch.tensor([100.0]), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    assert big["ratio_max"] == pytest.approx(math.exp(100.0), rel=1e-6)  # no float32 overflow


@pytest.mark.parametrize(
    "fields,start,expected",
    [
        ({"rejection_sampling": RejectionSamplingConfig("ratio", 5.0, "mask")}, None, None),
        ({"m2_threshold": 0.04}, "m2_threshold=0.04", "None unless use_decoupled_loss=true"),
        ({"m2_threshold": 0.0, "use_decoupled_loss": True, "recompute_logprob": True}, "m2_threshold=0.0", "> 0"),
        (
            {
                "m2_threshold": 0.04,
                "use_decoupled_loss": True,
                "recompute_logprob": True,
                "prox_logp_method": "loglinear",
            },
            "m2_threshold=0.04",
            "prox_logp_method=recompute",
        ),
    ],
)
def test_m2po_needs_the_proximal_forward(fields, start, expected):
    if start is None:
        ActorConfig(**fields)
        return
    with pytest.raises(ConfigError) as e:
        ActorConfig(**fields)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "fields,start,expected",
    [
        ({"lower": 1.0}, "lower=1.0", "in (0, 1)"),
        ({"lower": 0.0}, "lower=0.0", "in (0, 1)"),
        ({"agg": "max"}, "agg='max'", "mean | sum"),
        ({"agg": "sum"}, "agg='sum'", "'mean' unless level='sequence'"),
    ],
)
def test_bad_bounds_and_aggregations_are_refused(fields, start, expected):
    with pytest.raises(ConfigError) as e:
        RejectionSamplingConfig(**fields)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)
