"""A reward model in the reward pool (``reward.judge``): a language model reads each question, its completion
and the reference, and its parsed verdict is the reward.

``reward.judge: DIR`` (a local HF model directory, or ``gguf:SOURCE`` imported like ``model.path``) makes the
reward pool run ``judge`` instead of ``reward.fn``: every child process of the pool loads the model once
(``prepare``, before the child's memory cap), and each frame of checks the pool sends it (a group's share)
is judged in one batched greedy generation (``judge.batch``: left-padded, ``reward.judge_max_new_tokens``
new tokens). The prompt is ``reward.judge_template`` with ``{question}`` (the dataset's prompt text),
``{completion}`` and ``{solution}`` filled in, rendered through the judge's chat template when it has one;
the verdict is the first ``yes`` or ``no`` of the generated text (1.0 / 0.0; case-insensitive, whole
words). A generation with neither is an ``error`` outcome (score 0, the text in its detail), a hung or slow
batch is killed at ``reward.timeout_s`` like any check (a batch must finish within it), and the pool's
outcomes carry each check's wall time, which the reward workers report (``reward_check_s_total``,
``reward_checks_total`` in ``metrics.jsonl``).

The question travels with the completions when a judge is configured: the rollout worker looks the group's
prompt ids up in the run's dataset (``rollout.agent.PromptTexts``) and puts the text on its reward request
(``RewardRequest.prompt``), the pool passes it to ``judge.batch`` as ``prompts=``. A template that names
``{question}`` with a check that carries none is that check's ``error`` outcome, never a blank question.
Not covered: a judge served by a separate server, sampling the judge, scores other than yes/no.

torch and transformers are imported by ``prepare`` in the pool's children only: the reward worker that
builds the pool (and loads this module to check it) never loads them.
"""

from __future__ import annotations

import re
from typing import Optional

DEFAULT_TEMPLATE = (
    "Question: {question}\nReference answer: {solution}\nStudent answer: {completion}\n"
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


class NoQuestion(ValueError):
    """The judge's template reads ``{question}`` and the check carried none."""


def prompt_text(tokenizer, template: str, completion: str, solutions: list[str], question: str = "") -> str:
    """The judge's prompt for one completion (the first reference solution), chat-templated when possible."""
    if "{question}" in template and not question:
        raise NoQuestion("the judge's template reads {question} but this check carried no question")
    sol = (solutions[0] if solutions else "").strip()
    body = template.format(question=question.strip(), completion=completion.strip(), solution=sol)
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


def judge_batch(completions: list[str], solutions: list[list[str]], prompts: Optional[list[str]] = None, **kwargs):
    """One score (or the ``NoVerdict``/``NoQuestion`` that stands for an error) per completion, from one batched
    generation of those that have a prompt; ``prompts``: each completion's question."""
    prepare(**kwargs)
    questions = prompts if prompts is not None else [""] * len(completions)
    out: list = []
    for c, s, q in zip(completions, solutions, questions):
        try:
            out.append(prompt_text(_STATE["tok"], _STATE["template"], c, s, q))
        except NoQuestion as e:
            out.append(e)
    texts = generate([t for t in out if isinstance(t, str)]) if any(isinstance(t, str) for t in out) else []
    verdicts = iter(texts)
    return [_verdict(next(verdicts)) if isinstance(t, str) else t for t in out]


def _verdict(text: str):
    try:
        return parse_verdict(text)
    except NoVerdict as e:
        return e


def judge(completion: str, solutions: list[str], prompt: str = "", **kwargs) -> float:
    """``reward.fn``'s signature (+ the question): one completion judged (a pool child calls ``judge.batch``)."""
    (score,) = judge_batch([completion], [solutions], [prompt], **kwargs)
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
