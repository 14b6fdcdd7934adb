"""The tiny Llama the checks train and compare (random weights, built here: no download)."""

from __future__ import annotations

import torch
import transformers


def tiny_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)
