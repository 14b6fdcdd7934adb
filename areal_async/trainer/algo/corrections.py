"""Off-policy corrections that mask tokens before an update, and the masked fractions of the mismatch block.

Where each correction lives (docs/objectives.md#off-policy-corrections has the recipes):

- IcePop (token mask outside [lower, upper]), the geometric-mean sequence mask and MIS (a sequence's
  importance ratio, masked outside its bounds): ``actor.rejection_sampling`` (``loss.behav_importance``),
  judged per micro-batch (whole sequences never straddle one).
- M2PO: ``m2po_keep`` here, over a whole PPO minibatch before its update (``actor.m2_threshold``). The
  tokens it drops leave the loss and its token count, as AReaL's ``_apply_m2po_masking`` does (it edits the
  loss mask before ``ppo_actor_loss_fn``, whose denominator is the mask's count; areal/trainer/ppo/actor.py
  L446-448, L769-850). AReaL runs it per micro-batch call of the loss; here it is the minibatch, the batch
  the paper's second moment is taken over (Zheng et al. 2025, arXiv 2510.01161, eq. 4).

``masked_block`` turns the counts into the per-step columns ``masked_frac`` (any correction),
``masked_frac_rs`` (rejection sampling) and ``masked_frac_m2po``, fractions of the trained tokens.
"""

from __future__ import annotations

import torch


def m2po_keep(behav: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which of the ``mask`` tokens M2PO keeps: with m2 = (behav - prox)^2, the tokens of the largest m2 are
    dropped, largest first, until the mean m2 of the rest is below ``threshold``; at least one stays (AReaL
    ``_get_m2po_loss_mask``: all suffix means >= threshold drops all but the smallest). Tokens outside
    ``mask`` are False. Computed in float64."""
    if threshold <= 0:
        raise ValueError(f"m2po threshold={threshold!r}: expected > 0")
    mask = mask.bool()
    keep = torch.zeros_like(mask)
    d = behav.detach().double()[mask] - prox.detach().double()[mask]
    n = d.numel()
    if n == 0:
        return keep
    m2, order = torch.sort(d * d, descending=True)
    suffix_mean = m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype)
    below = torch.nonzero(suffix_mean < threshold)
    n_drop = int(below[0]) if below.numel() else n - 1
    kept_sorted = torch.arange(n) >= n_drop
    kept = torch.empty(n, dtype=torch.bool)
    kept[order] = kept_sorted
    keep[mask] = kept.to(keep.device)
    return keep


def masked_block(n_tokens: float, n_rejected: float, n_m2po: float) -> dict[str, float]:
    """The mismatch block's masked fractions of ``n_tokens`` trained tokens (rejection and M2PO never mask the
    same token twice in these counts: M2PO's tokens are out of the loss before rejection judges the rest)."""
    n = max(n_tokens, 1.0)
    return {
        "masked_frac": (n_rejected + n_m2po) / n,
        "masked_frac_rs": n_rejected / n,
        "masked_frac_m2po": n_m2po / n,
    }
