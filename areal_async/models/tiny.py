"""The policy model: a tiny Llama/Qwen2 built from ``ModelConfig`` numbers, or a local HF directory.

Covered: building a randomly initialised ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (seeded,
without touching the global RNG), saving model + tokenizer as HF safetensors, and loading
them back with ``local_files_only`` (never a hub download). Attention is ``sdpa``, which runs on
CPU and GPU alike.

Not covered: sharded/FSDP loading (the trainer's business), quantised weights, remote code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from areal_async.config import ModelConfig
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tokenizer import BOS_ID, EOS_ID, PAD_ID

_ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPL = "sdpa"


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; a torch.dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def hf_config(cfg: ModelConfig, vocab_size: int):
    """The HF config of the built tiny model (``build_model``; the preflight builds its module tree on meta)."""
    if cfg.arch not in _ARCHS:
        raise ValueError(f"model.arch={cfg.arch!r}: expected one of {sorted(_ARCHS)}")
    config_cls, _ = _ARCHS[cfg.arch]
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size={cfg.vocab_size}: fewer embedding rows than the tokenizer's {vocab_size}")
    return config_cls(
        vocab_size=cfg.vocab_size or vocab_size,
        rope_theta=cfg.rope_theta,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=True,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A randomly initialised tiny model; the same (cfg, vocab_size, seed) gives the same weights."""
    config = hf_config(cfg, vocab_size)
    config._attn_implementation = ATTN_IMPL
    with torch.random.fork_rng(devices=[]):  # seed the init without moving the caller's RNG
        torch.manual_seed(seed)
        model = _ARCHS[cfg.arch][1](config)
    return model.to(to_dtype(cfg.dtype)).eval()


def load_model(path: str | Path, dtype: str | torch.dtype = "float32") -> PreTrainedModel:
    """A causal LM from a local HF directory (never downloads)."""
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r}: expected a local HF directory with config.json")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=to_dtype(dtype), local_files_only=True, attn_implementation=ATTN_IMPL
    )
    return model.eval()


def load_policy(cfg: ModelConfig, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer): built (char tokenizer + tiny model) when ``cfg.path`` is None, else loaded."""
    if cfg.path is None:
        tokenizer = policy_tokenizer(cfg)
        return build_model(cfg, len(tokenizer), seed), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
    return load_model(cfg.path, cfg.dtype), tokenizer


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """Write model (safetensors) and tokenizer into ``path`` so that ``load_policy`` reads them back."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(str(path))
