"""Character tokenizer: exact round trip, special ids, save/load through AutoTokenizer, unknowns."""

import pytest
from transformers import AutoTokenizer

from areal_async.models.tokenizer import (
    BOS_ID,
    DEFAULT_ALPHABET,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    batch_decoder,
    build_char_tokenizer,
    check_encodable,
)

TEXTS = ["12+7=19", "  two  spaces, tab-less\nnew line. ", "Answer: \\boxed{42}\n\n", "a"]


def test_special_ids_and_vocab_size():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert len(tok) == 4 + len(DEFAULT_ALPHABET) == 100


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_per_char_and_exact_decode(text):
    tok = build_char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)  # no special tokens added, no merges
    assert tok.decode(ids) == text
    assert tok.decode([BOS_ID] + ids + [EOS_ID], skip_special_tokens=True) == text


def test_save_and_reload_with_autotokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text)
        assert tok2.decode(tok.encode(text)) == text
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (0, 1, 2)
    assert tok2("x<eos>").input_ids == [tok.convert_tokens_to_ids("x"), EOS_ID]


def test_unknown_chars_map_to_unk_and_check_encodable_names_them():
    tok = build_char_tokenizer("0123456789+=")
    assert tok.encode("1+x=2") == [5, 14, UNK_ID, 15, 6]
    check_encodable(tok, "12+3=15")
    with pytest.raises(ValueError, match="'x'"):
        check_encodable(tok, "1+x=2")


def test_bad_alphabets_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("abca")
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")


def test_batch_decoder_gives_each_lists_decode_and_keeps_clean_up(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    batch = [[BOS_ID] + tok.encode(t) + [EOS_ID] for t in TEXTS] + [[], [PAD_ID, EOS_ID], tok.encode("a .b")]
    for t in (tok, reloaded):
        assert batch_decoder(t)(batch) == TEXTS + ["", "", "a .b"]
        assert batch_decoder(t).func == t.backend_tokenizer.decode_batch  # one call for the batch
    # a tokenizer whose decode cleans spaces up (" ." -> ".") is decoded by it, one list at a time
    reloaded.clean_up_tokenization_spaces = True
    assert reloaded.decode(tok.encode("a .b"), skip_special_tokens=True) == "a.b"
    assert batch_decoder(reloaded)(batch) == [reloaded.decode(i, skip_special_tokens=True) for i in batch]
    assert batch_decoder(reloaded)(batch)[-1] == "a.b"
