"""A byte-level BPE tokenizer trained locally (no download), for models of a real shape.

``model.tokenizer: bpe`` (with ``model.path`` unset) gives the policy this tokenizer instead of the
character one: the kind of tokenizer Qwen2 and R1-Distill use (byte-level BPE: every byte string
encodes, multi-digit numbers and words merge into tokens), trained with ``tokenizers`` on a corpus
generated here from a fixed seed (arithmetic word problems with worked answers in ``\\boxed{}``,
the R1 instruction, ``<think>`` blocks), with ``BPE_VOCAB`` real tokens. A real model has more
embedding rows than real tokens (Qwen2.5: 151,665 tokens, 151,936 rows); ``model.vocab_size`` sets
the rows.

Special tokens keep the character tokenizer's ids (``tokenizer.PAD_ID`` 0, ``BOS_ID`` 1,
``EOS_ID`` 2, which the built models' configs name), then R1-Distill's turn markers. The chat
template has the form of DeepSeek-R1-Distill-Qwen's (``<｜User｜>``, ``<｜Assistant｜>``, the
generation prompt opening ``<think>\\n``), without its system and tool branches.

Training is deterministic (same corpus, same merges: a test trains twice); the result is cached
under ``$AREAL_ASYNC_CACHE`` (default ``~/.cache/areal-async``) in a directory named by a hash of
everything that defines it, written to a temporary directory and renamed into place, so workers
that start together read one tokenizer whoever built it.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from areal_async.models.tokenizer import BOS_ID, EOS_ID, PAD_ID

BPE_VOCAB = 8192  # real tokens (merges + 256 bytes + specials)
CORPUS_LINES = 20_000
CORPUS_SEED = 0
PAD, BOS, EOS = "<|endoftext|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = (PAD, BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
_VERSION = "bpe-1"  # bump when the corpus generator or the training recipe changes

_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Joy", "Randy"]
_THINGS = ["clips", "apples", "books", "pages", "dollars", "cookies", "marbles", "stickers", "eggs", "miles"]
_TEMPLATES = [
    ("{n} sold {a} {t} in April and {b} {t} in May. How many {t} did {n} sell altogether?", "{a} + {b}", "+"),
    ("{n} had {a} {t} and gave away {b}. How many {t} does {n} have left?", "{a} - {b}", "-"),
    ("{n} buys {a} boxes with {b} {t} in each box. How many {t} does {n} buy?", "{a} \\times {b}", "*"),
    ("What is {a} + {b}?", "{a} + {b}", "+"),
    ("What is {a} times {b}?", "{a} \\times {b}", "*"),
    ("Compute {a} - {b}.", "{a} - {b}", "-"),
]
R1_LINE = "Please reason step by step, and enclose your final answer in \\boxed{}."


def corpus(lines: int = CORPUS_LINES, seed: int = CORPUS_SEED):
    """Problems with worked answers, as the model would see and write them."""
    rng = random.Random(seed)
    for _ in range(lines):
        text, work, op = rng.choice(_TEMPLATES)
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        fill = dict(n=rng.choice(_NAMES), t=rng.choice(_THINGS), a=a, b=b)
        yield (
            f"{text.format(**fill)}\n{R1_LINE}\n<think>\nFirst, {work.format(**fill)} = {value}.\n</think>\n"
            f"The answer is \\boxed{{{value}}}."
        )


def _key(vocab: int) -> str:
    spec = repr((_VERSION, vocab, CORPUS_LINES, CORPUS_SEED, SPECIALS, CHAT_TEMPLATE, _TEMPLATES, _NAMES, _THINGS))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("AREAL_ASYNC_CACHE") or Path.home() / ".cache" / "areal-async") / "tokenizers"


def train_bpe(vocab: int = BPE_VOCAB, lines: int = CORPUS_LINES) -> Tokenizer:
    """Byte-level BPE trained on ``corpus()``: specials first (ids 0..6), then the 256 bytes, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(lines), trainer=trainer)
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    ids = (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id)
    if ids != (PAD_ID, BOS_ID, EOS_ID):  # the built models' configs name these ids
        raise AssertionError(f"BPE special ids {ids}: expected {(PAD_ID, BOS_ID, EOS_ID)}")
    return fast


def build_bpe_tokenizer(vocab: int = BPE_VOCAB) -> PreTrainedTokenizerFast:
    """The cached tokenizer, trained (a few seconds) and cached on first use."""
    path = cache_dir() / f"bpe-{vocab}-{_key(vocab)}" / "tokenizer.json"
    if not path.exists():
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent.parent) as tmp:
            train_bpe(vocab).save(str(Path(tmp) / "tokenizer.json"))
            try:
                os.rename(tmp, path.parent)  # atomic; another process may have won the race
            except OSError:
                if not path.exists():
                    raise
            else:
                os.mkdir(tmp)  # TemporaryDirectory removes what it created
    return _wrap(Tokenizer.from_file(str(path)))
