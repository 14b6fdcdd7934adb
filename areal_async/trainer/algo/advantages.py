"""Rewards and advantages for critic-free PPO (the boba recipe: GRPO-style, GAE with no values).

Covered:
- reward = (score + reward_bias) * reward_scaling, one scalar per sequence;
- reward normalization with independent mean/std levels: 'group' (samples sharing group_id),
  'batch' (all samples) or 'none';
- the sparse sequence reward placed on the last output token, minus an optional per-token KL
  penalty kl_ctl * (logp - ref_logp);
- per-token GAE with values fixed to 0 (no critic): A_t = sum_k (gamma*lambda)^k r_{t+k};
  with gamma = lambda = 1 every token's advantage is the sequence reward;
- advantage normalization (group | batch | none) over all output tokens.

- the advantage estimators of ``actor.adv_estimator`` as sequence-reward baselines before the GAE:
  grpo (the reward normalization above), rloo (r_i - mean of the other samples of its group =
  G/(G-1) (r_i - group mean)), reinforce_pp (no baseline; the advantages whitened over the batch
  by adv_norm batch/batch, verl's ``compute_reinforce_plus_plus_outcome_advantage``) and
  reinforce_pp_baseline (r_i - group mean, then whitened alike, verl's
  ``compute_rf_baseline_outcome_advantage``);
- DAPO's soft overlong punishment on the score, min(-(len - (max_new_tokens - overlong_tokens)) /
  overlong_tokens * factor, 0) (AReaL's ``reward_overlong_penalty``), and ``mask_no_eos_with_zero``
  (a sample cut at max_new_tokens gets sequence reward 0 after normalization, as AReaL leaves its
  reward out);
- the KL penalty with the k1/k2/k3 estimator of ``actor.kl_estimator`` (kl_in='reward').

Not covered: a learned critic, reward clipping.

Std convention: the unbiased (Bessel-corrected) std, as ``torch.std`` and AReaL use; a set of a
single value has std 0 (only ``eps`` remains in the denominator).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from areal_async.config import NORM_LEVELS, ActorConfig, NormConfig
from areal_async.trainer.algo.loss import kl_estimate
from protocols.trajectories import Trajectory


def scaled_rewards(scores: Sequence[float], reward_bias: float, reward_scaling: float) -> torch.Tensor:
    """(score + bias) * scaling, float64 so normalization stays exact for the tests' 1e-6."""
    return (torch.tensor(list(scores), dtype=torch.float64) + reward_bias) * reward_scaling


def _unbiased_std(x: torch.Tensor) -> torch.Tensor:
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype)
    return x.std(unbiased=True)


def _codes(level: str, group_ids: Sequence[str]) -> tuple[torch.Tensor, int]:
    """(the pool index of each sequence at this level, the number of pools)."""
    if level not in NORM_LEVELS:
        raise ValueError(f"normalization level {level!r}: expected one of {NORM_LEVELS}")
    if level == "batch":
        return torch.zeros(len(group_ids), dtype=torch.long), 1
    index: dict[str, int] = {}
    codes = [index.setdefault(g, len(index)) for g in group_ids]
    return torch.tensor(codes, dtype=torch.long), len(index)


def _pool_means(values_X: torch.Tensor, pool_X: torch.Tensor, n_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of each pool's elements, element count of each pool)."""
    counts = torch.bincount(pool_X, minlength=n_pools).to(values_X.dtype)
    sums = torch.zeros(n_pools, dtype=values_X.dtype).index_add_(0, pool_X, values_X)
    return sums / counts, counts


def normalize_flat(
    values_X: torch.Tensor, seq_X: torch.Tensor, group_ids: Sequence[str], norm: NormConfig
) -> torch.Tensor:
    """``normalize`` on the elements of every sequence laid end to end: ``seq_X`` is the index of
    the sequence each element belongs to. Pool statistics by scatter-adds, no per-sequence loop."""
    out = values_X
    if norm.mean_level != "none":
        codes, k = _codes(norm.mean_level, group_ids)
        pool_X = codes[seq_X]
        out = out - _pool_means(values_X, pool_X, k)[0][pool_X]
    if norm.std_level != "none":
        codes, k = _codes(norm.std_level, group_ids)
        pool_X = codes[seq_X]
        means, counts = _pool_means(values_X, pool_X, k)
        dev2 = torch.zeros(k, dtype=values_X.dtype).index_add_(0, pool_X, (values_X - means[pool_X]) ** 2)
        stds = torch.where(counts > 1, (dev2 / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(dev2))
        out = out / (stds[pool_X] + norm.eps)
    return out


def _seq_index(lengths: Sequence[int]) -> torch.Tensor:
    """(sum lengths,) index of the sequence each element belongs to."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths), dtype=torch.long))


def normalize(values: list[torch.Tensor], group_ids: Sequence[str], norm: NormConfig) -> list[torch.Tensor]:
    """Normalize per-sequence value tensors (1 reward or T advantages each) at norm's levels.

    mean and std at 'group'/'batch' pool every element of the member sequences, so a long
    sequence counts once per token (token-level, as the loss is). The std is taken of the raw
    values (around their own pool's mean), whatever the mean level.
    """
    if len(values) != len(group_ids):
        raise ValueError(f"{len(values)} value tensors but {len(group_ids)} group ids; expected equal counts")
    if not values:
        return []
    lengths = [v.numel() for v in values]
    flat = normalize_flat(torch.cat(values), _seq_index(lengths), group_ids, norm)
    return list(flat.split(lengths))


def token_rewards(
    seq_reward: float,
    n_tokens: int,
    kl_ctl: float = 0.0,
    logp_T: Optional[torch.Tensor] = None,
    ref_logp_T: Optional[torch.Tensor] = None,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Per-token rewards of one output: the sequence reward on the last token, minus the KL penalty
    kl_ctl * k(logp, ref) with the estimator k of ``loss.kl_estimate``."""
    r_T = torch.zeros(n_tokens, dtype=torch.float64)
    r_T[-1] = seq_reward
    if kl_ctl > 0:
        if logp_T is None or ref_logp_T is None:
            raise ValueError(f"kl_ctl={kl_ctl} > 0 needs logp_T and ref_logp_T; got None")
        r_T = r_T - kl_ctl * kl_estimate(logp_T.double(), ref_logp_T.double(), kl_estimator)
    return r_T


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, overlong_tokens: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of each output length: 0 up to max_new_tokens - overlong_tokens,
    then falling linearly to -factor at max_new_tokens (float64)."""
    exceed = torch.tensor(list(lengths), dtype=torch.float64) - (max_new_tokens - overlong_tokens)
    return torch.clamp(-exceed / overlong_tokens * factor, max=0.0)


def estimator_baseline(rewards: torch.Tensor, group_ids: Sequence[str], estimator: str) -> torch.Tensor:
    """Sequence rewards after ``adv_estimator``'s own baseline: grpo and reinforce_pp none (grpo's is the
    reward normalization), rloo r_i - mean_{j != i} r_j within the group, reinforce_pp_baseline r_i -
    group mean. A group of one sample has no leave-one-out baseline: refused."""
    if estimator in ("grpo", "reinforce_pp"):
        return rewards
    codes, k = _codes("group", group_ids)
    means, counts = _pool_means(rewards, codes, k)
    if estimator == "reinforce_pp_baseline":
        return rewards - means[codes]
    if estimator != "rloo":
        raise ValueError(f"adv_estimator={estimator!r}: expected grpo, rloo, reinforce_pp or reinforce_pp_baseline")
    if bool((counts < 2).any()):
        raise ValueError("adv_estimator=rloo: a group with one sample has no leave-one-out baseline; expected >= 2")
    n = counts[codes]
    return rewards - (means[codes] * n - rewards) / (n - 1)


def gae(rewards_T: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE with all values 0: delta_t = r_t, A_t = delta_t + gamma*lam*A_{t+1}."""
    c = gamma * lam
    if c == 1.0:  # the boba case: a reverse cumulative sum, exact and vectorized
        return rewards_T.flip(0).cumsum(0).flip(0)
    # c < 1: powers c^t underflow on long outputs, so no cumsum trick; a float loop is exact
    running, out = 0.0, [0.0] * rewards_T.numel()
    for t, r in zip(range(len(out) - 1, -1, -1), reversed(rewards_T.tolist())):
        running = r + c * running
        out[t] = running
    return torch.tensor(out, dtype=rewards_T.dtype)


def compute_advantages(
    trajs: Sequence[Trajectory],
    cfg: ActorConfig,
    logp: Optional[list[torch.Tensor]] = None,
    ref_logp: Optional[list[torch.Tensor]] = None,
    **length_info,
) -> list[torch.Tensor]:
    """Per-token advantages (float32, one tensor per trajectory's output) following cfg.

    logp / ref_logp: per-output-token logprobs of the old policy and the reference model; only
    read when cfg.kl_ctl > 0 with kl_in='reward'. ``length_info``: see ``sequence_rewards``.
    """
    flat = advantages_flat(trajs, cfg, logp, ref_logp, **length_info)
    return list(flat.split([t.output_ids.numel() for t in trajs]))


def sequence_rewards(
    trajs: Sequence[Trajectory],
    cfg: ActorConfig,
    max_new_tokens: Optional[int] = None,
    truncated: Optional[Sequence[bool]] = None,
) -> torch.Tensor:
    """Each trajectory's sequence reward (float64): the score (+ DAPO overlong penalty, needing
    ``max_new_tokens``), scaled, normalized (reward_norm), minus the estimator's baseline; 0 for the
    ``truncated`` ones (no eos) under mask_no_eos_with_zero."""
    scores = torch.tensor([t.score for t in trajs], dtype=torch.float64)
    if cfg.overlong_reward_penalty:
        if not max_new_tokens:
            raise ValueError("overlong_reward_penalty needs max_new_tokens (gconfig.max_new_tokens); got None")
        lengths = [t.output_ids.numel() for t in trajs]
        scores = scores + overlong_penalty(lengths, max_new_tokens, cfg.overlong_tokens, cfg.overlong_penalty_factor)
    group_ids = [t.group_id for t in trajs]
    rewards = (scores + cfg.reward_bias) * cfg.reward_scaling
    seq_r = normalize_flat(rewards, torch.arange(len(trajs)), group_ids, cfg.reward_norm)
    seq_r = estimator_baseline(seq_r, group_ids, cfg.adv_estimator)
    if cfg.mask_no_eos_with_zero:
        if truncated is None:
            raise ValueError("mask_no_eos_with_zero needs each trajectory's truncated flag; got None")
        seq_r = torch.where(torch.tensor(list(truncated), dtype=torch.bool), 0.0, seq_r)
    return seq_r


def advantages_flat(
    trajs: Sequence[Trajectory],
    cfg: ActorConfig,
    logp: Optional[list[torch.Tensor]] = None,
    ref_logp: Optional[list[torch.Tensor]] = None,
    max_new_tokens: Optional[int] = None,
    truncated: Optional[Sequence[bool]] = None,
) -> torch.Tensor:
    """``compute_advantages`` laid end to end: (total output tokens,) float32, trajectory order."""
    group_ids = [t.group_id for t in trajs]
    lengths = [t.output_ids.numel() for t in trajs]
    seq_r = sequence_rewards(trajs, cfg, max_new_tokens, truncated)
    seq_X = _seq_index(lengths)
    kl_ctl = cfg.kl_ctl if cfg.kl_in == "reward" else 0.0
    if kl_ctl == 0 and cfg.discount * cfg.gae_lambda == 1.0:
        # the boba case: every output token's advantage is its sequence's reward (gae of a
        # reward on the last token alone, exactly)
        advs = seq_r[seq_X]
    else:
        advs = torch.cat(
            [
                gae(
                    token_rewards(float(seq_r[i]), n, kl_ctl, _at(logp, i), _at(ref_logp, i), cfg.kl_estimator),
                    cfg.discount,
                    cfg.gae_lambda,
                )
                for i, n in enumerate(lengths)
            ]
        )
    if all(t.loss_mask is None for t in trajs):
        return normalize_flat(advs, seq_X, group_ids, cfg.adv_norm).float()
    # a workflow's environment tokens are not trained: the statistics pool only the trained ones
    keep_X = torch.cat(
        [torch.ones(n, dtype=torch.bool) if t.loss_mask is None else t.loss_mask.cpu() for n, t in zip(lengths, trajs)]
    )
    out = torch.zeros(advs.numel(), dtype=torch.float32)
    out[keep_X] = normalize_flat(advs[keep_X], seq_X[keep_X], group_ids, cfg.adv_norm).float()
    return out


def _at(values: Optional[list[torch.Tensor]], i: int) -> Optional[torch.Tensor]:
    return values[i] if values is not None else None
