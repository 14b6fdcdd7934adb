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

Not covered: a learned critic, reward clipping, length penalties.

Std convention: the unbiased (Bessel-corrected) std, as ``torch.std`` and AReaL use; a set of a
single value has std 0 (only ``eps`` remains in the denominator).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch

from areal_async.config import NORM_LEVELS, ActorConfig, NormConfig
from areal_async.trainer.types import Trajectory


def scaled_rewards(scores: Sequence[float], reward_bias: float, reward_scaling: float) -> torch.Tensor:
    """(score + bias) * scaling, float64 so normalization stays exact for the tests' 1e-6."""
    return (torch.tensor(list(scores), dtype=torch.float64) + reward_bias) * reward_scaling


def _unbiased_std(x: torch.Tensor) -> torch.Tensor:
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype)
    return x.std(unbiased=True)


def _keys(level: str, group_ids: Sequence[str]) -> list[str]:
    """The key whose pooled values give sequence i its statistics at this level."""
    if level not in NORM_LEVELS:
        raise ValueError(f"normalization level {level!r}: expected one of {NORM_LEVELS}")
    return ["<batch>"] * len(group_ids) if level == "batch" else list(group_ids)


def _pooled(values: list[torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    by_key: dict[str, list[torch.Tensor]] = defaultdict(list)
    for v, k in zip(values, keys):
        by_key[k].append(v)
    return {k: torch.cat(vs) for k, vs in by_key.items()}


def normalize(values: list[torch.Tensor], group_ids: Sequence[str], norm: NormConfig) -> list[torch.Tensor]:
    """Normalize per-sequence value tensors (1 reward or T advantages each) at norm's levels.

    mean and std at 'group'/'batch' pool every element of the member sequences, so a long
    sequence counts once per token (token-level, as the loss is). The std is taken of the raw
    values (around their own pool's mean), whatever the mean level.
    """
    if len(values) != len(group_ids):
        raise ValueError(f"{len(values)} value tensors but {len(group_ids)} group ids; expected equal counts")
    out = list(values)
    if norm.mean_level != "none":
        keys = _keys(norm.mean_level, group_ids)
        means = {k: p.mean() for k, p in _pooled(values, keys).items()}
        out = [v - means[k] for v, k in zip(out, keys)]
    if norm.std_level != "none":
        keys = _keys(norm.std_level, group_ids)
        stds = {k: _unbiased_std(p) for k, p in _pooled(values, keys).items()}
        out = [v / (stds[k] + norm.eps) for v, k in zip(out, keys)]
    return out


def token_rewards(
    seq_reward: float,
    n_tokens: int,
    kl_ctl: float = 0.0,
    logp_T: Optional[torch.Tensor] = None,
    ref_logp_T: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token rewards of one output: the sequence reward on the last token, minus the KL penalty."""
    r_T = torch.zeros(n_tokens, dtype=torch.float64)
    r_T[-1] = seq_reward
    if kl_ctl > 0:
        if logp_T is None or ref_logp_T is None:
            raise ValueError(f"kl_ctl={kl_ctl} > 0 needs logp_T and ref_logp_T; got None")
        r_T = r_T - kl_ctl * (logp_T.double() - ref_logp_T.double())
    return r_T


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
) -> list[torch.Tensor]:
    """Per-token advantages (float32, one tensor per trajectory's output) following cfg.

    logp / ref_logp: per-output-token logprobs of the old policy and the reference model; only
    read when cfg.kl_ctl > 0.
    """
    group_ids = [t.group_id for t in trajs]
    rewards = scaled_rewards([t.score for t in trajs], cfg.reward_bias, cfg.reward_scaling)
    seq_r = normalize([r.reshape(1) for r in rewards], group_ids, cfg.reward_norm)
    advs = []
    for i, t in enumerate(trajs):
        lp = logp[i] if logp is not None else None
        ref = ref_logp[i] if ref_logp is not None else None
        r_T = token_rewards(float(seq_r[i]), len(t.output_ids), cfg.kl_ctl, lp, ref)
        advs.append(gae(r_T, cfg.discount, cfg.gae_lambda))
    if all(t.loss_mask is None for t in trajs):
        return [a.float() for a in normalize(advs, group_ids, cfg.adv_norm)]
    # a workflow's environment tokens are not trained: the statistics pool only the trained ones
    masks = [
        torch.ones(len(a), dtype=torch.bool) if t.loss_mask is None else t.loss_mask.cpu() for a, t in zip(advs, trajs)
    ]
    normed = normalize([a[m] for a, m in zip(advs, masks)], group_ids, cfg.adv_norm)
    out = []
    for a, m, n in zip(advs, masks, normed):
        full = torch.zeros(len(a), dtype=torch.float32)
        full[m] = n.float()
        out.append(full)
    return out
