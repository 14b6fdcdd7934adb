"""The policy an RL run starts from (version 0): the built or loaded model after its optional SFT warm-up.

The trainer builds it at start; ``areal-async eval`` without ``--model`` builds the same one, so
both evaluate identical weights (same seed, same warm-up batches).
"""

from __future__ import annotations

from areal_async.app.workers.warmup_cache import cached_warmup
from areal_async.config import ExperimentConfig
from areal_async.data.prompts import keep_short, prompt_encoder, sft_examples, training_problems
from areal_async.models.tiny import load_policy
from areal_async.trainer.sft import SFTTrainer


def initial_policy(cfg: ExperimentConfig):
    """(model, tokenizer) of version 0."""
    model, tok = load_policy(cfg.model, cfg.seed)
    warmup(cfg, model, tok)
    return model, tok


def warmup(cfg: ExperimentConfig, model, tok) -> list[dict]:
    """The optional SFT warm-up that makes the initial weights (version 0), on the training prompts
    (not the held-out ones) within ``train_dataset.max_prompt_len`` rendered with ``train_dataset.template``;
    its result is kept on disk for the next run with the same inputs (``sft_warmup.cache``,
    app/workers/warmup_cache.py)."""
    if cfg.sft_warmup.steps == 0:
        return []
    d = cfg.train_dataset
    problems, train = training_problems(d, cfg.seed)  # never the held-out ones (train_dataset.holdout)
    kept = keep_short(problems, prompt_encoder(tok, d.template), d.max_prompt_len, among=train).kept
    examples = sft_examples([problems[i] for i in kept], tok, d.template)
    if not examples:
        raise ValueError("sft_warmup.steps > 0 but the training dataset has no 'answer' fields to imitate")
    trainer = SFTTrainer(model, cfg.sft_warmup, cfg.actor.mb_spec.max_tokens_per_mb, seed=cfg.seed)
    return cached_warmup(cfg, model, lambda: trainer.run(examples))  # stored once per key (app/workers/warmup_cache.py)
