"""PPO policy loss with token-level normalization and the decoupled (three-policy) objective.

Covered:
- the clipped surrogate max(-A*r, -A*clip(r, 1-eps, 1+eps)) per token;
- token-level normalization: sum over every loss token of the batch / number of loss tokens
  (NOT a per-sequence mean: a 100-token sequence weighs 10x a 10-token one). Under gradient
  accumulation the caller passes the global token count of the minibatch as ``n_tokens``;
- decoupled PPO (behaviour / proximal / current): r = exp(logp - prox_logp), each token weighted
  by w = exp(prox_logp - behav_logp); rejection by ``rejection_sampling`` ('mask' zeroes the
  loss of tokens with w > upper but keeps them in the token count, as AReaL's
  ``ppo_actor_loss_fn`` does: dropping them from the count would up-weight the survivors of a
  staler batch; 'clamp' clips w at upper);
- plain PPO: r = exp(logp - old_logp), old = prox if recompute_logprob else behaviour;
- an optional entropy bonus, and summable statistics (``LossStats``) so micro-batches merge
  exactly.

Not covered: value losses (no critic), dual clip, KL-in-loss (KL is a reward penalty here).
All inputs are flat per-token tensors of the same shape (the caller concatenates sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from areal_async.config import ActorConfig, RejectionSamplingConfig


@dataclass
class LossStats:
    """Sums over tokens, so that micro-batches merge by addition and means come out exact."""

    loss: float = 0.0  # sum of the (already normalized) loss values of the merged parts
    n_loss_tokens: float = 0.0  # tokens that entered the loss (after rejection)
    n_tokens: float = 0.0  # all tokens seen (kept + rejected)
    n_rejected: float = 0.0
    n_clipped: float = 0.0  # loss tokens where the clipped branch was taken
    iw_sum: float = 0.0  # behaviour importance weight exp(prox - behav) over all tokens, raw
    iw_max: float = 0.0
    kl_sum: float = 0.0  # 0.5 * (logp - old_logp)^2 over loss tokens
    behav_kl_sum: float = 0.0  # 0.5 * (prox_logp - behav_logp)^2 over all tokens: how far off-policy the data is
    entropy_sum: float = 0.0  # over loss tokens

    def merge(self, other: "LossStats") -> "LossStats":
        out = LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
        out.iw_max = max(self.iw_max, other.iw_max)
        return out

    def as_dict(self) -> dict[str, float]:
        k = max(self.n_loss_tokens, 1.0)
        return {
            "loss": self.loss,
            "clip_frac": self.n_clipped / k,
            "imp_weight_mean": self.iw_sum / max(self.n_tokens, 1.0),
            "imp_weight_max": self.iw_max,
            "rejected_frac": self.n_rejected / max(self.n_tokens, 1.0),
            "approx_kl": self.kl_sum / k,
            "behav_approx_kl": self.behav_kl_sum / max(self.n_tokens, 1.0),
            "entropy": self.entropy_sum / k,
            "n_loss_tokens": self.n_loss_tokens,
        }


def behav_importance(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, rs: RejectionSamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, keep): w = exp(prox - behav), rejection applied per rs. Constants (no grad)."""
    weight = torch.exp(prox_logp.detach().float() - behav_logp.detach().float())
    keep = torch.ones_like(weight, dtype=torch.bool)
    if rs.metric == "none":
        return weight, keep
    if rs.metric != "ratio":
        raise ValueError(f"rejection_sampling.metric={rs.metric!r}: expected 'ratio' or 'none'")
    if rs.mode == "mask":
        return weight, weight <= rs.upper
    if rs.mode == "clamp":
        return weight.clamp(max=rs.upper), keep
    raise ValueError(f"rejection_sampling.mode={rs.mode!r}: expected 'mask' or 'clamp'")


def loss_weights(
    prox_logp: Optional[torch.Tensor], behav_logp: torch.Tensor, cfg: ActorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, keep) of each token; weight 1 and keep all unless the loss is decoupled."""
    if cfg.use_decoupled_loss:
        if prox_logp is None:
            raise ValueError("use_decoupled_loss needs prox_logp; got None")
        return behav_importance(prox_logp, behav_logp, cfg.rejection_sampling)
    ones = torch.ones_like(behav_logp, dtype=torch.float32)
    return ones, torch.ones_like(ones, dtype=torch.bool)


def count_kept_tokens(
    prox_logp: Optional[torch.Tensor],
    behav_logp: torch.Tensor,
    cfg: ActorConfig,
    loss_mask: Optional[torch.Tensor] = None,
) -> int:
    """Tokens whose loss is not zeroed by rejection or the loss mask (the actor skips a step that keeps none).

    Known before the update because rejection depends only on prox and behaviour logprobs.
    The loss denominator is NOT this count: it is every trained output token (rejected ones included).
    """
    keep = loss_weights(prox_logp, behav_logp, cfg)[1]
    return int((keep & loss_mask).sum() if loss_mask is not None else keep.sum())


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A r, -A clip(r)) and the mask of tokens where clipping bound."""
    ratio = torch.exp(logp - old_logp.detach())
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


def policy_loss(
    logp: torch.Tensor,
    prox_logp: Optional[torch.Tensor],
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    cfg: ActorConfig,
    n_tokens: Optional[int] = None,
    entropy: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar loss = sum over kept tokens / n_tokens (default: this call's trained tokens, rejected ones included).

    Under gradient accumulation or data parallelism ``n_tokens`` is the global count of trained
    output tokens of the minibatch (over every micro-batch and rank). ``loss_mask`` (bool, per
    token; None = all): tokens outside it (a workflow's environment tokens) are in no sum, no
    count and no statistic."""
    old = prox_logp if (cfg.use_decoupled_loss or cfg.recompute_logprob) else behav_logp
    if old is None:
        raise ValueError("recompute_logprob / use_decoupled_loss need prox_logp; got None")
    weight, keep = loss_weights(prox_logp, behav_logp, cfg)
    mask = loss_mask.to(torch.bool) if loss_mask is not None else torch.ones_like(keep)
    keep = keep & mask
    tok_loss, clipped = clipped_surrogate(logp, old, adv, cfg.eps_clip)
    keep_f = keep.to(tok_loss.dtype)
    # rejected tokens stay in the denominator (AReaL: pg_loss.sum() / loss_mask_count)
    denom = max(float(n_tokens if n_tokens is not None else mask.sum()), 1.0)
    loss = (tok_loss * weight * keep_f).sum() / denom
    if entropy is not None and cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * (entropy * keep_f).sum() / denom
    return loss, _stats(loss, logp, old, behav_logp, prox_logp, keep, clipped, entropy, mask)


def _stats(loss, logp, old, behav_logp, prox_logp, keep, clipped, entropy, mask) -> LossStats:
    with torch.no_grad():
        iw = torch.exp(prox_logp.float() - behav_logp.float()) if prox_logp is not None else torch.ones_like(logp)
        kl = 0.5 * (logp.detach().float() - old.float()) ** 2
        log_iw = (prox_logp.float() - behav_logp.float()) if prox_logp is not None else torch.zeros_like(kl)
        iw = iw[mask]
        return LossStats(
            loss=float(loss.detach()),
            n_loss_tokens=float(keep.sum()),
            n_tokens=float(mask.sum()),
            n_rejected=float((mask & ~keep).sum()),
            n_clipped=float((clipped & keep).sum()),
            iw_sum=float(iw.sum()),
            iw_max=float(iw.max()) if iw.numel() else 0.0,
            kl_sum=float(kl[keep].sum()),
            behav_kl_sum=float((0.5 * log_iw[mask] ** 2).sum()),
            entropy_sum=float(entropy.detach()[keep].sum()) if entropy is not None else 0.0,
        )
