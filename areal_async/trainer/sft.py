"""Supervised fine-tuning on (prompt, answer) token pairs, packed like the RL update.

Covered: ``sft_step`` (one optimizer step: answer-token NLL, token-level mean over the whole
batch, packed micro-batches with gradient accumulation, grad clipping; an optional answer mask
leaves out answer tokens that are context, e.g. a tool's output in a tool-use trace) and ``SFTTrainer``, the
small loop behind ``sft_warmup`` (seeded shuffling, cycling through the examples).
Not covered: loss on prompt tokens (never trained), data loading/tokenization (callers pass ids).
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from areal_async.config import OptimizerConfig, SFTWarmupConfig
from areal_async.trainer.compute.logprobs import iter_micro_batches
from areal_async.trainer.compute.optim import build_optimizer, clip_grad_norm
from areal_async.trainer.compute.packing import select_attn_implementation

# (prompt_ids, answer_ids) or (prompt_ids, answer_ids, answer_mask): mask 0 marks answer tokens that are
# context, not imitated (a tool's output inside a tool-use trace)
Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]


def answer_mask(example: Example) -> list[int]:
    return list(example[2]) if len(example) > 2 else [1] * len(example[1])


def _check_examples(examples: Sequence[Example]) -> None:
    if not examples:
        raise ValueError("sft_step got no examples; expected at least one (prompt_ids, answer_ids)")
    for i, ex in enumerate(examples):
        prompt, answer, mask = ex[0], ex[1], answer_mask(ex)
        if not prompt or not answer:
            raise ValueError(
                f"example {i}: prompt has {len(prompt)} and answer {len(answer)} tokens; expected >= 1 of each"
            )
        if len(mask) != len(answer) or set(mask) - {0, 1} or 1 not in mask:
            raise ValueError(
                f"example {i}: answer mask {mask[:8]} ({len(mask)} long): expected one 0/1 per answer token "
                f"({len(answer)}), a 1 among them"
            )


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    examples: Sequence[Example],
    max_tokens_per_mb: int,
    *,
    grad_clip: float = 1.0,
    oversize: str = "error",
) -> dict:
    """One optimizer step of NLL on answer tokens (those of mask 1); returns loss, n_tokens, grad_norm."""
    _check_examples(examples)
    seqs = [list(ex[0]) + list(ex[1]) for ex in examples]
    masks = [answer_mask(ex) for ex in examples]
    n_tokens = sum(map(sum, masks))  # global count: micro-batches sum to a token mean
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in iter_micro_batches(model, seqs, 1.0, max_tokens_per_mb, oversize):
        # answer token j is scored by position P+j-1 of the L-1 next-token logprobs
        logp = mb.tails([len(examples[i][0]) - 1 for i in mb.indices])[0]
        w = torch.tensor([m for i in mb.indices for m in masks[i]], dtype=logp.dtype, device=logp.device)
        loss = -(logp * w).sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "n_tokens": float(n_tokens), "grad_norm": grad_norm}


class SFTTrainer:
    """Runs ``cfg.steps`` SFT steps of ``cfg.batch_size`` examples at ``cfg.lr`` (constant)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: SFTWarmupConfig,
        max_tokens_per_mb: int,
        seed: int = 0,
        grad_clip: float = 1.0,
    ):
        self.model = model
        self.cfg = cfg
        self.max_tokens_per_mb = max_tokens_per_mb
        self.grad_clip = grad_clip
        self.optimizer = build_optimizer(model.parameters(), OptimizerConfig(lr=cfg.lr))
        self._rng = random.Random(seed)

    def batches(self, examples: Sequence[Example]):
        """Endless seeded epochs over the examples, cut into batches of cfg.batch_size."""
        if not examples:
            raise ValueError("SFTTrainer got no examples; expected at least one")
        order: list[int] = []
        while True:
            while len(order) < self.cfg.batch_size:
                epoch = list(range(len(examples)))
                self._rng.shuffle(epoch)
                order += epoch
            yield [examples[i] for i in order[: self.cfg.batch_size]]
            order = order[self.cfg.batch_size :]

    def run(self, examples: Sequence[Example]) -> list[dict]:
        """cfg.steps steps; the per-step metrics, in order. The steps run with the packed attention
        the RL trainer uses (``select_attn_implementation``: the same attention within each
        sequence as a block mask, without its O(T^2) mask); the model's own comes back after."""
        stream = self.batches(examples)
        p = next(self.model.parameters())
        own = self.model.config._attn_implementation
        self.model.set_attn_implementation(select_attn_implementation(p.device, p.dtype))
        try:
            return [
                sft_step(self.model, self.optimizer, next(stream), self.max_tokens_per_mb, grad_clip=self.grad_clip)
                for _ in range(self.cfg.steps)
            ]
        finally:
            self.model.set_attn_implementation(own)
