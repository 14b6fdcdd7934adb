"""A character-level tokenizer for the embedded tiny model, built locally (no download).

Covered: one token per character of a fixed alphabet (default: printable ASCII 32..126 plus
newline), special tokens ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, exact decode (no
spaces inserted, no clean-up), and a round trip through ``save_pretrained`` /
``AutoTokenizer.from_pretrained``.

Unknown characters encode to ``<unk>`` (id 3) rather than raising: the tokenizer must behave the
same after ``AutoTokenizer`` reloads it, and a reloaded ``tokenizers`` WordLevel model can only
map unknowns to an unk token. Use :func:`check_encodable` where an error is wanted instead.

A minimal chat template (``CHAT_TEMPLATE``: ``<bos>User: ...\\nAssistant: ...<eos>\\n``, in the
alphabet) lets ``train_dataset.template`` chat / r1 run on the embedded model; it survives
``save_pretrained``. Not covered: merges/BPE. ``encode`` adds no special tokens; callers that want
a ``<bos>`` prefix or an ``<eos>`` suffix add them explicitly.
"""

from __future__ import annotations

import functools
from typing import Callable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
DEFAULT_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: "
    "{{ m['content'] }}{{ eos_token }}\n{% else %}User: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def _vocab(alphabet: str) -> dict[str, int]:
    dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if dupes:
        raise ValueError(f"alphabet has duplicate characters {dupes!r}: expected each character once")
    if not alphabet:
        raise ValueError("alphabet is empty: expected at least one character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(alphabet)})
    return vocab


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` (default printable ASCII + newline)."""
    vocab = _vocab(DEFAULT_ALPHABET if alphabet is None else alphabet)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "[\s\S]" rather than "." so that newlines are split out as characters too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate pieces: the default decoder would join with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # " ." must decode to " .", not "."
        padding_side="left",  # generation batches are left-padded
        chat_template=CHAT_TEMPLATE,
    )


def check_encodable(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    """Raise ``ValueError`` naming the first character of ``text`` the tokenizer maps to ``<unk>``."""
    unk = tokenizer.unk_token_id
    for ch in dict.fromkeys(text):  # unique characters, first-seen order
        if unk is not None and tokenizer.convert_tokens_to_ids(ch) == unk and ch != tokenizer.unk_token:
            raise ValueError(f"character {ch!r} in {text[:40]!r} is not in the tokenizer's alphabet")


def load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF directory (never downloads), or the character tokenizer when ``path`` is empty."""
    if not path:
        return build_char_tokenizer()
    from transformers import AutoTokenizer  # imports torch: the embedded default's scheduler never needs it

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


_PLAIN_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")  # backend decode + clean-up


def batch_decoder(tokenizer) -> Callable[[list[list[int]]], list[str]]:
    """Many id lists -> their texts, each exactly ``tokenizer.decode(ids, skip_special_tokens=True)``:
    one call into a fast tokenizer's backend for all of them when its ``decode`` adds nothing to the
    backend's (``_decode`` not overridden, no clean-up of spaces), one ``decode`` per list otherwise.
    The rollout worker decodes every sample: 256 short completions took ~2.4 ms one by one, ~0.2 ms so."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own = getattr(getattr(type(tokenizer), "_decode", None), "__qualname__", "")
    if backend is not None and own in _PLAIN_DECODES and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode_batch, skip_special_tokens=True)
    return lambda batch: [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch]
