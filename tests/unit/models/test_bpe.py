"""The locally trained byte-level BPE tokenizer (models/bpe.py) and the built model's embedding rows."""

from __future__ import annotations

import pytest

from areal_async.config import ModelConfig
from areal_async.models import bpe
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import BOS_ID, EOS_ID, PAD_ID


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_ASYNC_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield bpe.build_bpe_tokenizer()
    mp.undo()


def test_training_is_deterministic():
    """Every worker builds or reads the same tokenizer: two trainings give the same merges."""
    assert bpe.train_bpe(600, lines=2000).to_str() == bpe.train_bpe(600, lines=2000).to_str()


def test_special_ids_chat_template_and_byte_round_trip(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert len(tok) == bpe.BPE_VOCAB
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12+30?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 12+30?<｜Assistant｜><think>\n"
    for s in ("The answer is \\boxed{579}.", "héllo wörld ∑ 😀\n\ttabs", "   leading spaces"):
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s  # byte-level: any text round-trips


def test_numbers_and_words_merge(tok):
    """Merged tokens, as a real BPE has: the corpus' frequent words and answer forms are one token each."""
    pieces = tok.convert_ids_to_tokens(tok.encode("The answer is \\boxed{", add_special_tokens=False))
    assert pieces == ["The", "Ġanswer", "Ġis", "Ġ\\", "boxed", "{"]
    assert len(tok.encode("Please reason step by step", add_special_tokens=False)) == 5


def test_the_built_model_has_the_configured_rows_and_refuses_fewer(tok):
    cfg = ModelConfig(
        arch="qwen2",
        tokenizer="bpe",
        vocab_size=9000,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=1e6,
    )
    assert len(policy_tokenizer(cfg)) == len(tok)  # the cached one (AREAL_ASYNC_CACHE of the fixture)
    model = build_model(cfg, len(tok), seed=0)
    assert model.get_input_embeddings().num_embeddings == 9000
    assert model.config.rope_parameters["rope_theta"] == 1e6
    with pytest.raises(ValueError, match="model.vocab_size=100: fewer embedding rows than the tokenizer's 8192"):
        build_model(ModelConfig(vocab_size=100), len(tok), seed=0)
