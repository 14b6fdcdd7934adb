"""A reward model in the reward pool (``reward.judge``): a language model reads each completion beside the
reference and its parsed verdict is the reward.

``reward.judge: DIR`` (a local HF model directory, or ``gguf:SOURCE`` imported like ``model.path``) makes the
reward pool run ``judge`` instead of ``reward.fn``: every child process of the pool loads the model once
(``prepare``, before the child's memory cap), and each frame of checks the pool sends it (a group's share)
is judged in one batched greedy generation (``judge.batch``: left-padded, ``reward.judge_max_new_tokens``
new tokens). The prompt is ``reward.judge_template`` with ``{completion}`` and ``{solution}`` filled in,
rendered through the judge's chat template when it has one; the verdict is the first ``yes`` or ``no`` of
the generated text (1.0 / 0.0; case-insensitive, whole words). A generation with neither is an ``error``
outcome (score 0, the text in its detail), a hung or slow batch is killed at ``reward.timeout_s`` like any
check (a batch must finish within it), and the pool's outcomes carry each check's wall time, which the
reward workers report (``reward_check_s_total``, ``reward_checks_total`` in ``metrics.jsonl``).

The reward pipe carries completions and reference solutions, not prompts: the judge grades a completion
against the reference (reference-guided grading), without the question. Not covered: a judge served by a
separate server, sampling the judge, scores other than yes/no.

torch and transformers are imported by ``prepare`` in the pool's children only: the reward worker that
builds the pool (and loads this module to check it) never loads them.
"""

from __future__ import annotations

import re
from typing import Optional

DEFAULT_TEMPLATE = (
    "Reference answer: {solution}\nStudent answer: {completion}\n"
    "Does the student answer give the same final result as the reference answer? Answer yes or no."
)
VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_STATE: dict = {}  # this process's loaded judge: model, tokenizer, settings


class NoVerdict(ValueError):
    """The judge's generation held no yes/no."""


def parse_verdict(text: str) -> float:
    m = VERDICT.search(text)
    if m is None:
        raise NoVerdict(f"the judge gave no yes/no verdict: {text[:200]!r}")
    return 1.0 if m.group(1).lower() == "yes" else 0.0


def prompt_text(tokenizer, template: str, completion: str, solutions: list[str]) -> str:
    """The judge's prompt for one completion (the first reference solution), chat-templated when possible."""
    body = template.format(completion=completion.strip(), solution=(solutions[0] if solutions else "").strip())
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": body}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return body


def prepare(model: str, template: str = DEFAULT_TEMPLATE, max_new_tokens: int = 4, threads: int = 1, **_) -> None:
    """Load the judge into this process (once)."""
    if _STATE.get("model_path") == model:
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    _STATE.update(model_path=model, tok=tok, lm=lm, template=template, max_new_tokens=max_new_tokens)


def generate(texts: list[str]) -> list[str]:
    """Greedy continuations of ``texts`` in one left-padded batch (the judge loaded by ``prepare``)."""
    import torch

    tok, lm = _STATE["tok"], _STATE["lm"]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = lm.generate(
            **enc,
            max_new_tokens=_STATE["max_new_tokens"],
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def judge_batch(completions: list[str], solutions: list[list[str]], **kwargs) -> list:
    """One score (or the ``NoVerdict`` that stands for an error) per completion, from one batched generation."""
    prepare(**kwargs)
    texts = [prompt_text(_STATE["tok"], _STATE["template"], c, s) for c, s in zip(completions, solutions)]
    out: list = []
    for text in generate(texts):
        try:
            out.append(parse_verdict(text))
        except NoVerdict as e:
            out.append(e)
    return out


def judge(completion: str, solutions: list[str], **kwargs) -> float:
    """``reward.fn``'s signature: one completion judged (a pool child calls ``judge.batch`` for a frame)."""
    (score,) = judge_batch([completion], [solutions], **kwargs)
    if isinstance(score, Exception):
        raise score
    return score


judge.batch = judge_batch
judge.prepare = prepare
JUDGE_FN = "areal_async.reward.judge:judge"


def judge_kwargs(cfg) -> Optional[dict]:
    """The pool's ``fn_kwargs`` for a ``RewardConfig`` with ``judge`` set, else None."""
    if not cfg.judge:
        return None
    return {"model": cfg.judge, "template": cfg.judge_template, "max_new_tokens": cfg.judge_max_new_tokens}
