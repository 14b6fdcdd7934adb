"""benchmarks/scaled_model.py: the source's architecture at the widths asked for, random weights, the source's
tokenizer and template copied as they are."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from benchmarks.scaled_model import COPIED, write_scaled


def test_a_scaled_model_has_the_sources_architecture_at_the_new_size(tmp_path):
    src = tmp_path / "src"
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(src))
    for name in COPIED:
        (src / name).write_text(f"the source's {name}")
    n = write_scaled(tmp_path / "out", hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, seed=3, src=src)
    # by hand: tied embedding 100 x 64; a layer: q, o 64 x 64, k, v 64 x 32 (2 KV heads of 16), gate, up, down
    # 64 x 128, two norms of 64; the final norm 64
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert n == 100 * 64 + 2 * layer + 64
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["hidden_size"], out["num_hidden_layers"], out["intermediate_size"], out["head_dim"]) == (64, 2, 128, 16)
    assert (out["vocab_size"], out["tie_word_embeddings"], out["rope_parameters"]["rope_theta"]) == (
        100,
        True,
        100000.0,
    )
    for name in COPIED:
        assert (tmp_path / "out" / name).read_text() == f"the source's {name}"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == n and model.lm_head.weight is model.model.embed_tokens.weight
    again = write_scaled(
        tmp_path / "again", hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, seed=3, src=src
    )
    twin = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"), dtype=torch.float32)
    assert again == n and all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))  # seeded


def test_heads_that_do_not_divide_the_width_are_refused_naming_them(tmp_path):
    src = tmp_path / "src"
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(src))
    for hidden, heads, kv in ((64, 5, 5), (64, 4, 3)):
        with pytest.raises(ValueError, match=f"hidden {hidden}, heads {heads}, kv heads {kv}"):
            write_scaled(tmp_path / "out", hidden, 1, 128, heads, kv, seed=0, src=src)
    assert not (tmp_path / "out").exists()  # nothing written
