"""Sampling for ``TorchEngine``: what a batch's sampling parameters need (``SamplingMode``), and the
draw of one token per row (temperature, top-p, greedy) with its untruncated behaviour logprob."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_async.rollout.engine import GenRequest


@dataclass(frozen=True)
class SamplingMode:
    """What a batch's sampling parameters need, known without reading a tensor: rows that are all
    greedy, some greedy, some with top-p < 1, and whether every row samples at temperature 1
    (greedy rows count as temperature 1). A superset is always correct (e.g. after rows left)."""

    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    unit_temp: bool

    @classmethod
    def of_requests(cls, reqs: list[GenRequest]) -> "SamplingMode":
        greedy = [r.greedy for r in reqs]
        return cls(
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_p=any(r.top_p < 1 for r in reqs),
            unit_temp=all(r.greedy or float(r.temperature) == 1.0 for r in reqs),
        )

    @classmethod
    def of_tensors(cls, temp_B: torch.Tensor, top_p_B: torch.Tensor, greedy_B: torch.Tensor) -> "SamplingMode":
        return cls(
            all_greedy=bool(greedy_B.all()),
            any_greedy=bool(greedy_B.any()),
            any_top_p=bool((top_p_B < 1).any()),
            unit_temp=bool((greedy_B | (temp_B == 1)).all()),
        )

    def merge(self, other: "SamplingMode") -> "SamplingMode":
        return SamplingMode(
            all_greedy=self.all_greedy and other.all_greedy,
            any_greedy=self.any_greedy or other.any_greedy,
            any_top_p=self.any_top_p or other.any_top_p,
            unit_temp=self.unit_temp and other.unit_temp,
        )


def _top_p_filter(probs_BV: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row beyond its nucleus (the most likely token always stays)."""
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.cumsum(-1) - sorted_BV
    sorted_BV = sorted_BV.masked_fill(mass_before_BV >= top_p_B[:, None], 0.0)
    return torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)


def sample_tokens(
    logits_BV: torch.Tensor,
    temp_B: torch.Tensor,
    top_p_B: torch.Tensor,
    greedy_B: torch.Tensor,
    gen: torch.Generator,
    mode: SamplingMode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_B, behaviour logprob_B): logprob = log_softmax(logits / T)[token], T = 1 for greedy,
    taken before top-p truncation (the distribution the trainer recomputes). ``mode``: what the
    parameters need (read from the tensors when None); the steps it rules out are skipped."""
    mode = mode or SamplingMode.of_tensors(temp_B, top_p_B, greedy_B)
    if logits_BV.dtype != torch.float32:
        logits_BV = logits_BV.float()
    if not mode.unit_temp:
        logits_BV = logits_BV / torch.where(greedy_B, torch.ones_like(temp_B), temp_B)[:, None]
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if mode.all_greedy:
        tok_B = logp_BV.argmax(-1)
    else:
        probs_BV = logp_BV.exp()
        if mode.any_top_p:
            probs_BV = _top_p_filter(probs_BV, top_p_B)
        tok_B = draw_tokens(probs_BV, gen)
        if mode.any_greedy:
            tok_B = torch.where(greedy_B, logp_BV.argmax(-1), tok_B)
    return tok_B, logp_BV.gather(1, tok_B[:, None]).squeeze(1)


def draw_tokens(probs_BV: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row, token v with probability probs_BV[b, v] / the row's sum (rows need not
    be normalised; a zero-probability token is never drawn): the first token whose cumulative
    mass exceeds a uniform draw below the row's mass. One random number per row, where
    ``torch.multinomial`` draws one per token (most of the sampling time at small batch shapes)."""
    cdf_BV = probs_BV.cumsum(-1)
    mass_B1 = cdf_BV[:, -1:]
    u_B1 = torch.rand(mass_B1.shape, generator=gen, device=cdf_BV.device, dtype=cdf_BV.dtype) * mass_B1
    u_B1 = torch.minimum(u_B1, torch.nextafter(mass_B1, torch.zeros_like(mass_B1)))  # < mass despite rounding
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1)
