"""How far the trained tokens' behaviour policy was from the proximal policy, per trainer step.

Per output token t (loss-mask tokens only): the gap |log pi_prox(t) - log pi_behav(t)| and the
lag ``step - version(t)`` (trainer steps since the weights that generated it). A token generated
by the weights being trained (lag 0) differs only by numerics (the engine's decode against the
trainer's packed forward); each version of lag adds one update's move. Columns:

    logp_gap_mean, logp_gap_p50, logp_gap_p99, logp_gap_max   over every token of the step
    kl_k3                                  mean of k3 = (w - 1) - log w, w = exp(prox - behav): an
                                           unbiased estimate of KL(behav || prox) from tokens drawn by behav
    logp_gap_{mean,p50,p99,max}_lag{k}, kl_k3_lag{k}, tokens_lag{k}   the same, per lag k present
    ess_frac                               effective sample size of the importance weights
                                           w = exp(prox - behav), as a fraction of the tokens:
                                           (sum w)^2 / (n sum w^2), 1 when every w is equal
    ratio_max, ratio_p99, ratio_p1, ratio_min   the weight w = exp(prox - behav) itself: its tails, the
                                           values IcePop / MIS / TIS bounds cut (float64, then float)

With the masked fractions of ``corrections.masked_block`` (what the active corrections took out of the
loss) these are the step's mismatch block, which ``areal-async plot`` draws and ``doctor`` reads.

p50 and p99 are nearest-rank percentiles (the smallest value with >= 50 / 99 % of tokens at or below
it: the ``ceil(q n)``-th smallest), so a hand count can check them. The lag-0 columns of step 0 are the
engine's version-0 log-probs against the trainer's recompute of the same weights: numerics alone
(``areal-async doctor`` shows them).
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
    return float((values if values.is_floating_point() else values.float()).kthvalue(k).values)


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
    out = _gap_columns(log_w, "") | {"ess_frac": ess_fraction(log_w)} | ratio_columns(log_w)
    for lag in sorted(set(lags.tolist())):
        lw = log_w[lags == lag]
        out |= _gap_columns(lw, f"_lag{lag}") | {f"tokens_lag{lag}": float(lw.numel())}
    return out


def _gap_columns(log_w: torch.Tensor, suffix: str) -> dict[str, float]:
    gap = log_w.abs()
    k3 = torch.expm1(log_w.double()) - log_w.double()  # (w - 1) - log w, >= 0
    return {
        f"logp_gap_mean{suffix}": float(gap.mean()),
        f"logp_gap_p50{suffix}": nearest_rank(gap, 0.5),
        f"logp_gap_p99{suffix}": nearest_rank(gap, 0.99),
        f"logp_gap_max{suffix}": float(gap.max()),
        f"kl_k3{suffix}": float(k3.mean()),
    }


def ratio_columns(log_w: torch.Tensor) -> dict[str, float]:
    """max, p99, p1 and min (nearest rank) of w = exp(log_w), exponentiated in float64 (exp of a float32
    log weight past 88 would be inf)."""
    w = torch.exp(log_w.double())
    return {
        "ratio_max": float(w.max()),
        "ratio_p99": nearest_rank(w, 0.99),
        "ratio_p1": nearest_rank(w, 0.01),
        "ratio_min": float(w.min()),
    }


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
