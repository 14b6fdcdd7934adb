"""How far the trained tokens' behaviour policy was from the proximal policy, per trainer step.

Per output token t (loss-mask tokens only): the gap |log pi_prox(t) - log pi_behav(t)| and the
lag ``step - version(t)`` (trainer steps since the weights that generated it). A token generated
by the weights being trained (lag 0) differs only by numerics (the engine's decode against the
trainer's packed forward); each version of lag adds one update's move. Columns:

    logp_gap_mean, logp_gap_p99            over every token of the step
    logp_gap_mean_lag{k}, logp_gap_p99_lag{k}, tokens_lag{k}   the same, per lag k present
    ess_frac                               effective sample size of the importance weights
                                           w = exp(prox - behav), as a fraction of the tokens:
                                           (sum w)^2 / (n sum w^2), 1 when every w is equal

p99 is the nearest-rank 99th percentile (the smallest value with >= 99 % of tokens at or below
it: ``ceil(0.99 n)``-th smallest), so a hand count can check it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def nearest_rank(values: torch.Tensor, q: float) -> float:
    """The ``ceil(q n)``-th smallest of ``values`` (nan for none)."""
    n = values.numel()
    if n == 0:
        return float("nan")
    k = max(1, math.ceil(q * n))
    return float(values.float().kthvalue(k).values)


def mismatch_metrics(
    prox: torch.Tensor, behav: torch.Tensor, lags: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> dict[str, float]:
    """The columns above from per-token tensors of equal length (``mask``: the tokens that count)."""
    if not (prox.numel() == behav.numel() == lags.numel()):
        raise ValueError(
            f"prox, behav, lags have {prox.numel()}, {behav.numel()}, {lags.numel()} tokens; expected equal"
        )
    log_w, lags = prox.detach().float().cpu() - behav.detach().float().cpu(), lags.cpu().long()
    if mask is not None:
        keep = mask.cpu().bool()
        log_w, lags = log_w[keep], lags[keep]
    if log_w.numel() == 0:
        return {}
    gap = log_w.abs()
    out = {"logp_gap_mean": float(gap.mean()), "logp_gap_p99": nearest_rank(gap, 0.99), "ess_frac": ess_fraction(log_w)}
    for lag in sorted(set(lags.tolist())):
        g = gap[lags == lag]
        out |= {f"logp_gap_mean_lag{lag}": float(g.mean()), f"logp_gap_p99_lag{lag}": nearest_rank(g, 0.99)}
        out[f"tokens_lag{lag}"] = float(g.numel())
    return out


def ess_fraction(log_w: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) for w = exp(log_w), computed shifted by max(log_w) (no overflow)."""
    w = torch.exp(log_w.double() - log_w.max().double())
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


class GapCollector:
    """Per-token proximal and behaviour logprobs and lags, gathered micro-batch by micro-batch
    (when the proximal logprobs come from the update's own forward or are approximated there)."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, prox: torch.Tensor, behav: torch.Tensor, lags: torch.Tensor, mask: torch.Tensor) -> None:
        self.parts.append(tuple(x.detach().cpu() for x in (prox, behav, lags, mask)))

    def metrics(self) -> dict[str, float]:
        if not self.parts:
            return {}
        prox, behav, lags, mask = (torch.cat(x) for x in zip(*self.parts))
        return mismatch_metrics(prox, behav, lags, mask.bool())
