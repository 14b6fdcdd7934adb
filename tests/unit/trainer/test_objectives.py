"""The objective keys of issue 26, each on tiny tensors against values worked out by hand here (float64).

Anchors: the formulas are AReaL's (``areal/utils/functional/functional.py`` ppo_actor_loss_fn, GSPO's
_compute_sequence_level_ratio_and_advantages, reward_overlong_penalty; ``areal/trainer/ppo/actor.py``
compute_prox_logp_approximations), verl's (agg_loss, the REINFORCE++ estimators) and TRL's (dr_grpo's
normaliser). No anchor is run here: the hand arithmetic in each test is the reference.
"""

import math

import pytest
import torch

from areal_async.config import ActorConfig, NormConfig, RejectionSamplingConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.algo.advantages import (
    advantages_flat,
    estimator_baseline,
    overlong_penalty,
    sequence_rewards,
    token_rewards,
)
from areal_async.trainer.algo.loss import (
    agg_scale,
    behav_importance,
    kl_estimate,
    loglinear_prox,
    policy_loss,
    surrogate,
)
from protocols.trajectories import Trajectory

D = torch.float64
NONE = NormConfig(mean_level="none", std_level="none")


def t(*xs):
    return torch.tensor(xs, dtype=D)


def plain(**kw):
    """Plain PPO, old = behaviour: the ratio is exp(logp - behav)."""
    return ActorConfig(**kw)


def test_clip_higher_widens_only_the_upper_clip():
    # ratios 1.5, 0.5, 1.25 with A = 1, -1, 1; eps_low 0.2, eps_high 0.28:
    #  r=1.5, A=1:   max(-1.5, -1.28) = -1.28 (clipped at 1.28)
    #  r=0.5, A=-1:  max(0.5, 0.8) = 0.8 (clipped at 0.8: the lower clip is eps_clip's)
    #  r=1.25, A=1:  1.25 < 1.28, unclipped: -1.25 (symmetric 0.2 would give -1.2)
    logp, behav, adv = t(math.log(1.5), math.log(0.5), math.log(1.25)), t(0, 0, 0), t(1, -1, 1)
    loss, s = policy_loss(logp, None, behav, adv, plain(eps_clip=0.2, eps_clip_higher=0.28))
    assert float(loss) == pytest.approx((-1.28 + 0.8 - 1.25) / 3, abs=1e-12)
    assert s.n_clipped == 2
    sym, _ = policy_loss(logp, None, behav, adv, plain(eps_clip=0.2))
    assert float(sym) == pytest.approx((-1.2 + 0.8 - 1.2) / 3, abs=1e-12)


def test_dual_clip_caps_negative_advantage_loss_at_c_times_abs_a():
    # c_clip 3, eps 0.2:
    #  A=-1, r=5: max(5, 1.2) = 5 -> min(5, 3*1) = 3 (dual clip binds)
    #  A=-2, r=2: max(4, 2.4) = 4 -> min(4, 6) = 4
    #  A=1,  r=5: max(-5, -1.2) = -1.2 -> min(-1.2, 3) = -1.2
    tok, clipped, dual = surrogate(t(5, 2, 5), t(-1, -2, 1), 0.2, 0.2, c_clip=3.0)
    assert tok.tolist() == pytest.approx([3.0, 4.0, -1.2], abs=1e-12)
    assert dual.tolist() == [True, False, False] and clipped.tolist() == [False, False, True]
    logp = torch.log(t(5, 2, 5)).requires_grad_()
    loss, s = policy_loss(logp, None, t(0, 0, 0), t(-1, -2, 1), plain(c_clip=3.0))
    assert float(loss.detach()) == pytest.approx((3 + 4 - 1.2) / 3, abs=1e-12) and s.n_dual_clipped == 1
    loss.backward()  # the capped token and the clipped one carry no gradient; d(-A r)/dlogp = -A r = 4 for token 2
    assert logp.grad.tolist() == pytest.approx([0.0, 4 / 3, 0.0], abs=1e-12)


def test_gspo_sequence_ratio_is_the_geometric_mean_and_advantage_the_sequence_mean():
    # two sequences, lengths 2 and 1; log r = [0.1, 0.3 | -0.2]; A = [1, 3 | -1]
    #  seq 1: ratio exp(0.2) = 1.2214 > 1.2, mean A = 2: max(-2*1.2214, -2*1.2) = -2.4 on both tokens (clipped)
    #  seq 2: ratio exp(-0.2) = 0.8187 in [0.8, 1.2], A = -1: 0.8187
    logp = t(0.1, 0.3, -0.2).requires_grad_()
    cfg = plain(importance_sampling_level="sequence", loss_agg_mode="seq-mean-token-mean")
    mask = torch.ones(3, dtype=torch.bool)
    scale = agg_scale(mask, [2, 1], "seq-mean-token-mean").double()
    loss, s = policy_loss(logp, None, t(0, 0, 0), t(1, 3, -1), cfg, scale=scale, seq_lens=[2, 1])
    r2 = math.exp(-0.2)
    assert float(loss.detach()) == pytest.approx((-2.4 + r2) / 2, abs=1e-7)  # scale is float32
    assert s.n_clipped == 2
    loss.backward()
    # seq 2's loss r2 * 1 over N_seq = 2: d/dlogp3 = 0.5 * r2 * d(mean log r)/dlogp3 = 0.5 * r2; seq 1 clipped: 0
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.5 * r2], abs=1e-7)
    with pytest.raises(ValueError, match="needs seq_lens"):
        policy_loss(logp, None, t(0, 0, 0), t(1, 3, -1), cfg)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (-1 - 2 - 3 - 4) / 4),  # every token counts once
        ("seq-mean-token-sum", ((-1 - 2 - 3) + (-4)) / 2),  # each sequence's sum, averaged over sequences
        ("seq-mean-token-mean", ((-1 - 2 - 3) / 3 + (-4)) / 2),  # each sequence's mean, averaged
        ("seq-mean-token-sum-norm", ((-1 - 2 - 3) + (-4)) / (2 * 5)),  # Dr.GRPO: / (N_seq * max_new_tokens=5)
    ],
)
def test_loss_aggregation_modes_by_hand(mode, expected):
    # ratio 1 everywhere (logp = behav): each token's loss is -A; sequences of 3 and 1 tokens, A = [1, 2, 3 | 4]
    adv, zeros, mask = t(1, 2, 3, 4), t(0, 0, 0, 0), torch.ones(4, dtype=torch.bool)
    scale = agg_scale(mask, [3, 1], mode, max_new_tokens=5).double()
    loss, _ = policy_loss(zeros, None, zeros, adv, plain(loss_agg_mode=mode), scale=scale, seq_lens=[3, 1])
    assert float(loss) == pytest.approx(expected, abs=1e-7)
    # micro-batches: the first sequence in one call, the second in another, with the minibatch's scales
    a, _ = policy_loss(zeros[:3], None, zeros[:3], adv[:3], plain(), scale=scale[:3], seq_lens=[3])
    b, _ = policy_loss(zeros[3:], None, zeros[3:], adv[3:], plain(), scale=scale[3:], seq_lens=[1])
    assert float(a + b) == pytest.approx(expected, abs=1e-7)


def test_agg_scale_leaves_out_masked_tokens_and_needs_the_budget_for_the_norm_mode():
    # sequence 1 has 3 tokens of which 1 is an environment token: its mean is over 2
    s = agg_scale(torch.tensor([True, False, True, True]), [3, 1], "seq-mean-token-mean")
    assert s.tolist() == pytest.approx([1 / (2 * 2), 0.0, 1 / (2 * 2), 1 / 2], abs=1e-7)
    with pytest.raises(ValueError, match="max_new_tokens"):
        agg_scale(torch.ones(2, dtype=torch.bool), [2], "seq-mean-token-sum-norm")


def test_kl_estimators_by_hand():
    d = t(0.5, -0.5)  # logp - ref
    assert kl_estimate(d, t(0, 0), "k1").tolist() == pytest.approx([0.5, -0.5], abs=1e-12)
    assert kl_estimate(d, t(0, 0), "k2").tolist() == pytest.approx([0.125, 0.125], abs=1e-12)
    # k3 = exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.1065307, exp(0.5) - 1.5 = 0.1487213
    assert kl_estimate(d, t(0, 0), "k3").tolist() == pytest.approx([0.10653066, 0.14872127], abs=1e-8)


def test_kl_in_the_loss_adds_kl_ctl_times_its_mean_and_its_gradient():
    # ratio 1, A = 0: the policy term is 0; KL term 0.1 * mean(k3) with d = [0.5, -0.5]
    logp = t(0.5, -0.5).requires_grad_()
    cfg = plain(kl_ctl=0.1, kl_in="loss", kl_estimator="k3")
    loss, _ = policy_loss(logp, None, logp.detach().clone(), t(0, 0), cfg, ref_logp=t(0, 0))
    assert float(loss) == pytest.approx(0.1 * (0.10653066 + 0.14872127) / 2, abs=1e-8)
    loss.backward()  # d k3 / d logp = 1 - exp(-d): 1 - 0.6065307, 1 - 1.6487213; times 0.1 / 2
    assert logp.grad.tolist() == pytest.approx([0.05 * (1 - 0.60653066), 0.05 * (1 - 1.64872127)], abs=1e-8)
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(logp, None, logp.detach(), t(0, 0), cfg)


def test_kl_in_the_reward_with_k2():
    # reward 1 on the last token; penalty 0.1 * d^2 / 2 per token, d = [0.2, -0.4]: 0.002, 0.008
    r = token_rewards(1.0, 2, 0.1, t(0.2, -0.4), t(0, 0), "k2")
    assert r.tolist() == pytest.approx([-0.002, 1 - 0.008], abs=1e-12)


def traj(sid, gid, score, n_out=1, last=3):
    ids = [4] * (n_out - 1) + [last]
    return Trajectory(sid, gid, [1], ids, [0.0] * n_out, [0] * n_out, score)


def test_rloo_and_reinforce_baselines_by_hand():
    r, g = t(1, 0, 0, 1, 1), ["a", "a", "a", "b", "b"]
    # rloo: r_i - mean of the others. a: 1 - 0 = 1, 0 - (1+0)/2 = -0.5 (twice); b: 1 - 1 = 0
    assert estimator_baseline(r, g, "rloo").tolist() == pytest.approx([1, -0.5, -0.5, 0, 0], abs=1e-12)
    # reinforce_pp_baseline: r - group mean: a mean 1/3, b mean 1
    assert estimator_baseline(r, g, "reinforce_pp_baseline").tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, 0, 0], abs=1e-12
    )
    assert estimator_baseline(r, g, "reinforce_pp").tolist() == r.tolist()
    with pytest.raises(ValueError, match="one sample"):
        estimator_baseline(t(1, 0), ["a", "b"], "rloo")


def test_reinforce_pp_whitens_the_token_advantages_over_the_batch():
    # scores 1, 0, 0 on outputs of 1, 2, 1 tokens, gamma = 1: token advantages [1 | 0, 0 | 0]
    # batch whitening: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    trajs = [traj("x", "a", 1.0, 1), traj("y", "a", 0.0, 2), traj("z", "a", 0.0, 1)]
    cfg = ActorConfig(adv_estimator="reinforce_pp", reward_norm=NONE, adv_norm=NormConfig("batch", "batch", 0.0))
    assert advantages_flat(trajs, cfg).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-6)
    rloo = ActorConfig(adv_estimator="rloo", reward_norm=NONE, adv_norm=NONE)
    # rloo: 1 - 0 = 1, 0 - 0.5 = -0.5 (on both tokens of y), 0 - 0.5 = -0.5
    assert advantages_flat(trajs, rloo).tolist() == pytest.approx([1.0, -0.5, -0.5, -0.5], abs=1e-6)


def test_overlong_penalty_and_no_eos_masking_by_hand():
    # max_new_tokens 10, overlong_tokens 4, factor 1: free up to 6 tokens, then -1/4 per token
    assert overlong_penalty([5, 6, 8, 10], 10, 4, 1.0).tolist() == pytest.approx([0, 0, -0.5, -1.0], abs=1e-12)
    trajs = [traj(f"s{n}", "g", 1.0, n) for n in (5, 6, 8, 10)]
    cfg = ActorConfig(
        overlong_reward_penalty=True, overlong_tokens=4, overlong_penalty_factor=1.0, reward_norm=NONE, adv_norm=NONE
    )
    assert sequence_rewards(trajs, cfg, max_new_tokens=10).tolist() == pytest.approx([1, 1, 0.5, 0], abs=1e-12)
    masked = ActorConfig(mask_no_eos_with_zero=True, reward_norm=NONE, adv_norm=NONE, reward_bias=-0.5)
    # scores 1 -> reward 0.5 each; the truncated one gets 0
    got = sequence_rewards(trajs, masked, 10, truncated=[False, False, False, True]).tolist()
    assert got == pytest.approx([0.5, 0.5, 0.5, 0.0], abs=1e-12)


def test_the_actor_calls_a_sample_truncated_when_it_fills_the_budget_without_eos():
    actor = PPOActor(torch.nn.Linear(1, 1), ActorConfig(), 1.0, 1, max_new_tokens=3, eos_token_ids=[2])
    assert actor._truncated(traj("a", "g", 1, 3, last=5))  # 3 tokens, last not eos: cut
    assert not actor._truncated(traj("b", "g", 1, 3, last=2))  # eos exactly at the budget: ended
    assert not actor._truncated(traj("c", "g", 1, 2, last=5))  # shorter than the budget: ended
    with pytest.raises(ValueError, match="need max_new_tokens"):
        PPOActor(torch.nn.Linear(1, 1), ActorConfig(mask_no_eos_with_zero=True), 1.0, 1)


def test_tis_truncates_the_behaviour_weight_after_rejection():
    prox, behav = torch.log(t(0.5, 2.0, 6.0)), t(0, 0, 0)
    w, keep = behav_importance(prox, behav, RejectionSamplingConfig("none", 5.0, "mask"), cap=3.0)
    assert w.tolist() == pytest.approx([0.5, 2.0, 3.0], abs=1e-6) and keep.all()
    w, keep = behav_importance(prox, behav, RejectionSamplingConfig("ratio", 5.0, "mask"), cap=3.0)
    assert w.tolist() == pytest.approx([0.5, 2.0, 3.0], abs=1e-6) and keep.tolist() == [True, True, False]


def test_sequence_level_rejection_judges_the_geometric_mean():
    # seq 1: w = 2, 8 -> exp(mean log w) = sqrt(16) = 4 > 3: both tokens rejected, weight 4 each
    # seq 2: w = 1.5 -> kept with weight 1.5
    prox, behav = torch.log(t(2.0, 8.0, 1.5)), t(0, 0, 0)
    rs = RejectionSamplingConfig("ratio", 3.0, "mask", level="sequence")
    w, keep = behav_importance(prox, behav, rs, seq_lens=[2, 1])
    assert w.tolist() == pytest.approx([4.0, 4.0, 1.5], abs=1e-6) and keep.tolist() == [False, False, True]
    rs = RejectionSamplingConfig("ratio", 3.0, "clamp", level="sequence")
    w, keep = behav_importance(prox, behav, rs, seq_lens=[2, 1])
    assert w.tolist() == pytest.approx([3.0, 3.0, 1.5], abs=1e-6) and keep.all()


def test_loglinear_proximal_approximation_as_areal_defines_it():
    # current version 5; token versions 5, 4, 3, 1: alpha = clamp((4 - v) / (5 - v), 0, 1) where v < 5, else 0
    #  v=5: 0 (diff 0); v=4: 0/1 = 0; v=3: 1/2; v=1: 3/4
    behav, logp = t(-1, -1, -1, -1), t(-0.2, -0.2, -0.2, -0.2)
    got = loglinear_prox(behav, logp, torch.tensor([5, 4, 3, 1]), 5)
    assert got.tolist() == pytest.approx([-1.0, -1.0, -0.6, -0.4], abs=1e-6)
    assert not got.requires_grad


REFUSED = [  # (fields, the message's start, what it expects)
    ({"eps_clip_higher": 0.0}, "eps_clip_higher=0.0", "> 0 or None"),
    ({"c_clip": 1.0}, "c_clip=1.0", "> 1 or None"),
    ({"kl_estimator": "k4"}, "kl_estimator='k4'", "k1 | k2 | k3"),
    ({"kl_in": "both"}, "kl_in='both'", "reward | loss"),
    ({"kl_in": "loss"}, "kl_in='loss'", "needs kl_ctl > 0"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level='seq'", "token | sequence"),
    ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode='seq-mean'", "seq-mean-token-sum-norm"),
    ({"adv_estimator": "gae"}, "adv_estimator='gae'", "grpo | rloo"),
    ({"adv_estimator": "rloo"}, "reward_norm='group/group'", "none/none with adv_estimator=rloo"),
    (
        {"adv_estimator": "reinforce_pp", "reward_norm": NONE, "adv_norm": NONE},
        "adv_norm='none/none'",
        "batch/batch with adv_estimator=reinforce_pp",
    ),
    ({"overlong_reward_penalty": True}, "overlong_tokens=None", ">= 1 with overlong_reward_penalty=true"),
    ({"overlong_tokens": 4}, "overlong_tokens=4", "None unless overlong_reward_penalty=true"),
    (
        {"overlong_reward_penalty": True, "overlong_tokens": 4, "overlong_penalty_factor": 0.0},
        "overlong_penalty_factor=0.0",
        "> 0",
    ),
    ({"behav_imp_weight_cap": 2.0}, "behav_imp_weight_cap=2.0", "None unless use_decoupled_loss=true"),
    (
        {
            "behav_imp_weight_cap": 2.0,
            "use_decoupled_loss": True,
            "recompute_logprob": True,
            "rejection_sampling": RejectionSamplingConfig("ratio", 5.0, "clamp"),
        },
        "behav_imp_weight_cap=2.0",
        "None with rejection_sampling.mode=clamp",
    ),
    ({"behav_imp_weight_cap": 1.0, "use_decoupled_loss": True}, "behav_imp_weight_cap=1.0", "> 1"),
    ({"prox_logp_method": "loglinear"}, "prox_logp_method='loglinear'", "unless use_decoupled_loss=true"),
    ({"prox_logp_method": "metrics"}, "prox_logp_method='metrics'", "recompute | loglinear"),
]


@pytest.mark.parametrize("fields,start,expected", REFUSED, ids=[r[1] for r in REFUSED])
def test_bad_objective_values_and_combinations_are_refused_naming_the_key(fields, start, expected):
    from areal_async.config import ConfigError

    with pytest.raises(ConfigError) as e:
        ActorConfig(**fields)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


FLEET_REFUSED = [
    (
        [
            "actor.adv_estimator=rloo",
            *[f"actor.reward_norm.{k}=none" for k in ("mean_level", "std_level")],
            "gconfig.n_samples=1",
        ],
        "gconfig.n_samples=1",
        ">= 2 with actor.adv_estimator=rloo",
    ),
    (
        [
            "actor.overlong_reward_penalty=true",
            "actor.overlong_tokens=16",
            "actor.overlong_penalty_factor=1.0",
            "gconfig.max_new_tokens=16",
        ],
        "actor.overlong_tokens=16",
        "< gconfig.max_new_tokens=16",
    ),
    (["actor.mask_no_eos_with_zero=true", "rollout.workflow=m:W"], "rollout.workflow='m:W'", "a workflow's episode"),
    (
        [
            "actor.use_decoupled_loss=true",
            "actor.recompute_logprob=true",
            "actor.prox_logp_method=loglinear",
            "cluster.n_trainer_ranks=2",
        ],
        "actor.prox_logp_method='loglinear'",
        "n_trainer_ranks > 1",
    ),
    (["actor.kl_in=loss"], "actor.kl_in='loss'", "needs kl_ctl > 0"),
]


@pytest.mark.parametrize("overrides,start,expected", FLEET_REFUSED, ids=[r[1] for r in FLEET_REFUSED])
def test_objective_rules_across_sections_name_the_dotted_key(overrides, start, expected):
    from areal_async.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({}, overrides)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


def _counted_forwards(cfg):
    from test_trainer_actor import make_trajs, tiny_model

    model = tiny_model()
    trajs = make_trajs(model, n_each=3)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))  # once a forward, whichever path
    actor = PPOActor(model, cfg, 1.0, 10, max_new_tokens=4, eos_token_ids=[])
    m = actor.train_step(trajs)
    return len(calls), m


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loglinear_runs_no_proximal_forward_and_the_objectives_train_through_the_actor(agg):
    from test_trainer_actor import boba_cfg

    kw = dict(ppo_n_minibatches=2, loss_agg_mode=agg, importance_sampling_level="sequence", eps_clip_higher=0.3)
    n_recompute, m_re = _counted_forwards(boba_cfg(**kw))
    n_loglinear, m_ll = _counted_forwards(boba_cfg(prox_logp_method="loglinear", **kw))
    # recompute: a proximal forward per micro-batch, then the update's; loglinear: the update's only
    assert n_loglinear == m_ll["n_microbatches"] and n_recompute > n_loglinear
    assert m_re["optimizer_steps"] == m_ll["optimizer_steps"] == 2 and math.isfinite(m_ll["loss"])


RECIPES = {  # preset -> the keys its recipe is made of (the comment block of each file cites the source)
    "tiny_grpo.yaml": dict(adv_estimator="grpo", loss_agg_mode="token-mean", reward_norm=("group", "group")),
    "tiny_dapo.yaml": dict(eps_clip=0.2, eps_clip_higher=0.28, loss_agg_mode="token-mean", overlong_tokens=4),
    "tiny_drgrpo.yaml": dict(loss_agg_mode="seq-mean-token-sum-norm", reward_norm=("group", "none")),
    "tiny_gspo.yaml": dict(importance_sampling_level="sequence", eps_clip=3e-4, eps_clip_higher=4e-4),
    "tiny_rloo.yaml": dict(adv_estimator="rloo", reward_norm=("none", "none")),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_presets_spell_their_recipe(name):
    from pathlib import Path

    from areal_async.config import load_config

    path = Path(__file__).resolve().parents[3] / "configs" / name
    cfg = load_config(path)
    for key, want in RECIPES[name].items():
        got = getattr(cfg.actor, key)
        assert ((got.mean_level, got.std_level) if isinstance(want, tuple) else got) == want, (name, key)
    assert (cfg.rollout.dynamic_filter == "nonzero_std") == (name == "tiny_dapo.yaml")
    assert path.read_text().startswith("# ") and "arXiv" in path.read_text().split("\n\n")[0]
