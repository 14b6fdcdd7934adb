"""Sampling for ``TorchEngine``: what a batch's sampling parameters need (``SamplingMode``), and the
draw of one token per row (temperature, top-p, greedy) with its untruncated behaviour logprob."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_async.rollout.engines.engine import GenRequest


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
    parameters need (read from the tensors when None); the steps it rules out are skipped.

    Without top-p no (B, V) log-softmax is made: the tokens are drawn from exp(z - max z), whose row
    sums give the log-normaliser, and each row's logprob is z[token] - max z - log(sum) (log-softmax's
    own arithmetic, for one token a row): two passes over the logits fewer, which at a 49k vocabulary
    is most of the sampling time."""
    mode = mode or SamplingMode.of_tensors(temp_B, top_p_B, greedy_B)
    if logits_BV.dtype != torch.float32:
        logits_BV = logits_BV.float()
    if not mode.unit_temp:
        logits_BV = logits_BV / torch.where(greedy_B, torch.ones_like(temp_B), temp_B)[:, None]
    if mode.any_top_p:
        return _sample_top_p(logits_BV, top_p_B, greedy_B, gen, mode)
    max_B1 = logits_BV.amax(-1, keepdim=True)
    if mode.all_greedy:
        tok_B = logits_BV.argmax(-1)
        mass_B1 = torch.sub(logits_BV, max_B1).exp_().sum(-1, keepdim=True)
    else:
        tok_B, mass_B1 = draw_tokens(torch.sub(logits_BV, max_B1).exp_(), gen, with_mass=True)
        if mode.any_greedy:
            tok_B = torch.where(greedy_B, logits_BV.argmax(-1), tok_B)
    lse_B = (max_B1 + mass_B1.log()).squeeze(1)
    return tok_B, logits_BV.gather(1, tok_B[:, None]).squeeze(1) - lse_B


def token_entropy(logits_BV: torch.Tensor, temp_B: torch.Tensor, greedy_B: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row's sampling distribution softmax(logits / T), T = 1 for greedy, before top-p
    truncation: the distribution ``sample_tokens``' behaviour logprob is taken from. A pass over the logits
    more, made only when asked (``rollout.token_entropy``)."""
    z_BV = logits_BV.float() / torch.where(greedy_B, torch.ones_like(temp_B), temp_B)[:, None]
    logp_BV = torch.log_softmax(z_BV, dim=-1)
    return -(logp_BV.exp() * logp_BV).sum(-1)


def _sample_top_p(logits_BV, top_p_B, greedy_B, gen, mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` with some rows' top-p < 1: the nucleus drawn from the normalised probabilities."""
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    tok_B = draw_tokens(_top_p_filter(logp_BV.exp(), top_p_B), gen)
    if mode.any_greedy:
        tok_B = torch.where(greedy_B, logp_BV.argmax(-1), tok_B)
    return tok_B, logp_BV.gather(1, tok_B[:, None]).squeeze(1)


BLOCK = 256  # draw_tokens: tokens per block of a wide row
BLOCKED_MIN_V = 4096  # rows at least this wide are drawn block first


def draw_tokens(probs_BV: torch.Tensor, gen: torch.Generator, with_mass: bool = False):
    """One token per row, token v with probability probs_BV[b, v] / the row's sum (rows need not
    be normalised; a zero-probability token is never drawn): the first token whose cumulative
    mass exceeds a uniform draw below the row's mass. One random number per row, where
    ``torch.multinomial`` draws one per token (most of the sampling time at small batch shapes).
    ``with_mass``: also return the rows' masses (B, 1).

    Rows of ``BLOCKED_MIN_V`` tokens or more are drawn in two levels with the same draw: the block of
    ``BLOCK`` tokens where the cumulative block masses first exceed it, then the token inside that block
    where its cumulative masses first exceed what is left of the draw. The same distribution (a block
    with no mass is never chosen: the cumulative masses do not rise there), with one pass over the row
    (the block sums) where a cumulative sum of the whole row reads and writes it."""
    B, V = probs_BV.shape
    if V < BLOCKED_MIN_V:
        cdf_BV = probs_BV.cumsum(-1)
        mass_B1 = cdf_BV[:, -1:]
        tok_B = torch.searchsorted(cdf_BV, _uniform_below(mass_B1, gen), right=True).squeeze(1)
        return (tok_B, mass_B1) if with_mass else tok_B
    n_blocks = -(-V // BLOCK)
    if V % BLOCK:  # pad the tail block with zeros (never drawn)
        probs_BV = torch.nn.functional.pad(probs_BV, (0, n_blocks * BLOCK - V))
    blocks_BNK = probs_BV.view(B, n_blocks, BLOCK)
    cdf_BN = blocks_BNK.sum(-1).cumsum(-1)
    mass_B1 = cdf_BN[:, -1:]
    u_B1 = _uniform_below(mass_B1, gen)
    j_B1 = torch.searchsorted(cdf_BN, u_B1, right=True)
    before_B1 = torch.where(j_B1 > 0, cdf_BN.gather(1, (j_B1 - 1).clamp(min=0)), torch.zeros_like(u_B1))
    inner_BK = blocks_BNK.gather(1, j_B1[:, :, None].expand(B, 1, BLOCK)).squeeze(1).cumsum(-1)
    left_B1 = torch.minimum((u_B1 - before_B1).clamp(min=0), _below(inner_BK[:, -1:]))
    tok_B = (j_B1 * BLOCK + torch.searchsorted(inner_BK, left_B1, right=True)).squeeze(1)
    return (tok_B, mass_B1) if with_mass else tok_B


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float below each element (a draw must stay below a mass despite rounding)."""
    return torch.nextafter(x, torch.zeros_like(x))


def _uniform_below(mass_B1: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    u_B1 = torch.rand(mass_B1.shape, generator=gen, device=mass_B1.device, dtype=mass_B1.dtype) * mass_B1
    return torch.minimum(u_B1, _below(mass_B1))
