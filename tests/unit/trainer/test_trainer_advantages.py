"""Rewards, reward normalization, GAE and advantage normalization against plain-Python loops."""

import math

import pytest
import torch

from areal_async.config import ActorConfig, NormConfig
from areal_async.trainer.algo.advantages import compute_advantages, gae, normalize, token_rewards
from protocols.trajectories import Trajectory

SCORES = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5]
GROUPS = ["a", "a", "a", "b", "b", "b", "c"]
LENS = [3, 5, 2, 4, 1, 6, 3]


def trajs(scores=SCORES, groups=GROUPS, lens=LENS):
    return [
        Trajectory(f"s{i}", g, [1, 2], [7] * n, [-1.0] * n, [0] * n, s)
        for i, (s, g, n) in enumerate(zip(scores, groups, lens))
    ]


# ---- independent reference: lists and loops only --------------------------------------------


def mean(xs):
    return sum(xs) / len(xs)


def ustd(xs):
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_norm(per_seq, groups, mean_level, std_level, eps=1e-5):
    """per_seq: list of lists; statistics pool all elements of the member sequences."""

    def pool(i, level):
        members = [j for j in range(len(per_seq)) if level == "batch" or groups[j] == groups[i]]
        return [x for j in members for x in per_seq[j]]

    out = []
    for i, vals in enumerate(per_seq):
        m = mean(pool(i, mean_level)) if mean_level != "none" else 0.0
        d = ustd(pool(i, std_level)) + eps if std_level != "none" else 1.0
        out.append([(v - m) / d for v in vals])
    return out


def ref_advantages(cfg, scores=SCORES, groups=GROUPS, lens=LENS):
    r = [[(s + cfg.reward_bias) * cfg.reward_scaling] for s in scores]
    r = ref_norm(r, groups, cfg.reward_norm.mean_level, cfg.reward_norm.std_level)
    advs = []
    for (ri,), n in zip(r, lens):
        a, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = (ri if t == n - 1 else 0.0) + cfg.discount * cfg.gae_lambda * running
            a[t] = running
        advs.append(a)
    return ref_norm(advs, groups, cfg.adv_norm.mean_level, cfg.adv_norm.std_level)


def close(got, want, tol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=tol)


# ---- tests -----------------------------------------------------------------------------------


def test_hand_values_group_norm_two_samples():
    # scores 1/0 -> rewards +5/-5; group mean 0, unbiased std sqrt(50) -> +-5/(sqrt(50)+eps)
    cfg = ActorConfig(reward_scaling=10.0, reward_bias=-0.5, adv_norm=NormConfig("none", "none"))
    got = compute_advantages(trajs([1.0, 0.0], ["g", "g"], [2, 3]), cfg)
    v = 5.0 / (math.sqrt(50.0) + 1e-5)
    close(got, [[v, v], [-v, -v, -v]])


@pytest.mark.parametrize("bias,scale", [(-0.5, 10.0), (0.0, 1.0), (-0.5, -5.0), (5.0, 5.0)])
def test_scaling_and_bias_without_normalization(bias, scale):
    cfg = ActorConfig(
        reward_scaling=scale,
        reward_bias=bias,
        reward_norm=NormConfig("none", "none"),
        adv_norm=NormConfig("none", "none"),
    )
    got = compute_advantages(trajs(), cfg)
    close(got, [[(s + bias) * scale] * n for s, n in zip(SCORES, LENS)])


def test_boba_plus_minus_five():
    cfg = ActorConfig(
        reward_scaling=10.0,
        reward_bias=-0.5,
        reward_norm=NormConfig("none", "none"),
        adv_norm=NormConfig("none", "none"),
    )
    got = compute_advantages(trajs([1.0, 0.0], ["g", "g"], [3, 2]), cfg)
    close(got, [[5.0] * 3, [-5.0] * 2])


@pytest.mark.parametrize(
    "rnorm", [("group", "group"), ("batch", "batch"), ("group", "batch"), ("batch", "none"), ("none", "none")]
)
@pytest.mark.parametrize("anorm", [("batch", "batch"), ("group", "group"), ("none", "none")])
def test_normalization_levels_match_loops(rnorm, anorm):
    cfg = ActorConfig(
        reward_scaling=10.0, reward_bias=-0.5, reward_norm=NormConfig(*rnorm), adv_norm=NormConfig(*anorm)
    )
    close(compute_advantages(trajs(), cfg), ref_advantages(cfg))


def test_gamma_lambda_one_gives_sequence_reward_on_every_token():
    r_T = token_rewards(2.5, 4)
    assert r_T.tolist() == [0.0, 0.0, 0.0, 2.5]
    assert gae(r_T, 1.0, 1.0).tolist() == [2.5] * 4


def test_gae_discounted_against_loop():
    rewards = [0.3, -1.0, 0.0, 2.0, 0.7]
    gamma, lam = 0.9, 0.8
    want = [sum((gamma * lam) ** (k - t) * rewards[k] for k in range(t, 5)) for t in range(5)]
    assert gae(torch.tensor(rewards, dtype=torch.float64), gamma, lam).tolist() == pytest.approx(want, abs=1e-12)
    cfg = ActorConfig(discount=0.9, gae_lambda=0.8, reward_scaling=3.0, reward_bias=0.1)
    close(compute_advantages(trajs(), cfg), ref_advantages(cfg))


def test_kl_penalty_per_token():
    cfg = ActorConfig(kl_ctl=0.1, reward_norm=NormConfig("none", "none"), adv_norm=NormConfig("none", "none"))
    logp = [torch.tensor([-1.0, -2.0, -0.5])]
    ref = [torch.tensor([-1.5, -1.0, -0.5])]
    got = compute_advantages(trajs([1.0], ["g"], [3]), cfg, logp, ref)
    r = [-0.1 * 0.5, -0.1 * -1.0, 1.0 - 0.0]  # reward minus kl_ctl * (logp - ref) per token
    close(got, [[r[0] + r[1] + r[2], r[1] + r[2], r[2]]])


def test_kl_needs_logprobs_and_levels_are_checked():
    with pytest.raises(ValueError, match="kl_ctl"):
        token_rewards(1.0, 3, kl_ctl=0.1)
    norm = NormConfig()
    norm.mean_level = "token"  # NormConfig("token") itself is refused when built
    with pytest.raises(ValueError, match="'token'"):
        normalize([torch.ones(2)], ["g"], norm)


def test_trajectory_validation():
    with pytest.raises(ValueError, match="len\\(logprobs\\)=1, expected len\\(output_ids\\)=2"):
        Trajectory("x", "g", [1], [2, 3], [-1.0], [0, 0], 1.0)
    with pytest.raises(ValueError, match="empty output_ids"):
        Trajectory("x", "g", [1], [], [], [], 1.0)
    with pytest.raises(ValueError, match="len\\(versions\\)=3, expected len\\(output_ids\\)=2"):
        Trajectory("x", "g", [1], [2, 3], [-1.0, -1.0], [0, 0, 0], 1.0)
    with pytest.raises(ValueError, match="empty prompt_ids"):
        Trajectory("x", "g", torch.tensor([], dtype=torch.int32), [2], [-1.0], [0], 1.0)
    t = Trajectory("x", "g", [1], torch.tensor([2.0, 3.0]), [-1, -2], torch.tensor([1, 2], dtype=torch.int16), 1.0)
    assert (t.output_ids.dtype, t.versions.dtype, t.logprobs.dtype) == (torch.int32, torch.int32, torch.float32)
    assert t.output_ids.tolist() == [2, 3] and t.logprobs.tolist() == [-1.0, -2.0]


def test_trajectory_keeps_received_tensors():
    """Tensors of their column's dtype (views of a received message) are kept, not copied; lists and other
    dtypes become the column's one dtype (int32 ids and versions), as on the wire."""
    buf = torch.tensor([4, 5, 6, 7, 3, 3, 3], dtype=torch.int32)
    t = Trajectory("x", "g", buf[:1], buf[1:4], torch.zeros(3), buf[4:], 1.0)
    assert t.output_ids.data_ptr() == buf[1:4].data_ptr() and t.output_ids.dtype == torch.int32
    assert t.versions.data_ptr() == buf[4:].data_ptr() and t.min_version == 3
    assert t.seq_parts[0].tolist() == [4] and t.seq_parts[1].tolist() == [5, 6, 7]
    listed = Trajectory("y", "g", [1], [2, 3], [-1.0, -1.0], [0, 0], 1.0)
    assert listed.output_ids.dtype == torch.int32 and listed.versions.dtype == torch.int32
    floats = Trajectory("z", "g", torch.tensor([1.0]), [2], [-1.0], [0], 1.0)
    assert floats.prompt_ids.dtype == torch.int32
