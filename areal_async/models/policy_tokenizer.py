"""The policy's tokenizer, the same in every role: ``model.path``'s own, else the built model's
(``model.tokenizer``: the character tokenizer, or the locally trained byte-level BPE)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from areal_async.config import ModelConfig
from areal_async.models.bpe import build_bpe_tokenizer
from areal_async.models.tokenizer import build_char_tokenizer, load_tokenizer


def policy_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.path:
        return load_tokenizer(cfg.path)
    return build_bpe_tokenizer() if cfg.tokenizer == "bpe" else build_char_tokenizer()
