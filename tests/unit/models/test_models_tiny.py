"""Tiny model build / save / load: identical logits after a round trip, seeding, local-only loads."""

import pytest
import torch

from areal_async.config import ModelConfig
from areal_async.models.tiny import build_model, load_model, load_policy, save_policy

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_save_load_round_trip_gives_identical_logits(tmp_path, arch, tie):
    cfg = ModelConfig(arch=arch, tie_word_embeddings=tie, **CFG)
    model, tok = load_policy(cfg, seed=3)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    save_policy(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model2, tok2 = load_policy(ModelConfig(path=str(tmp_path)), seed=99)  # seed unused when loading
    ids = torch.tensor([tok.encode("12+30=42\n")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert tok2.encode("12+30=42") == tok.encode("12+30=42")


def test_build_is_seeded_and_leaves_global_rng_alone():
    cfg = ModelConfig(**CFG)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a, b, c = build_model(cfg, 50, seed=1), build_model(cfg, 50, seed=1), build_model(cfg, 50, seed=2)
    assert torch.rand(1).item() == before.item()
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.vocab_size == 50 and a.config.num_key_value_heads == 2


def test_dtype_and_bad_inputs():
    assert next(build_model(ModelConfig(dtype="bfloat16", **CFG), 20, 0).parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="arch='gpt2'"):
        ModelConfig(arch="gpt2", **CFG)  # the config refuses it when built ...
    cfg = ModelConfig(**CFG)
    cfg.arch = "gpt2"  # ... and build_model when a built config was changed after
    with pytest.raises(ValueError, match="model.arch='gpt2'"):
        build_model(cfg, 20, 0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model("/nonexistent/model/dir")
