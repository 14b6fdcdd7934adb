"""A reward model in the reward pool (``reward.judge``): a language model reads each question, its completion
and the reference, and its parsed verdict is the reward.

``reward.judge: DIR`` (a local HF model directory, or ``gguf:SOURCE`` imported like ``model.path``) makes the
reward pool run ``judge`` instead of ``reward.fn``: every child process of the pool loads the model once
(``prepare``, before the child's memory cap), and each frame of checks the pool sends it (a group's share)
is judged in one batch. The prompt is ``reward.judge_template`` with ``{question}`` (the dataset's prompt
text), ``{completion}`` and ``{solution}`` (the first reference; a reasoning-gym entry gives its oracle
answer, ``reference_text``) filled in, rendered through the judge's chat template when it has one and
``reward.judge_chat`` is on (off: the text as it is, a few-shot prompt the judge continues).

``reward.judge_verdict: text``: one left-padded greedy generation (``reward.judge_max_new_tokens`` new
tokens); the verdict is the first ``yes`` or ``no`` of the generated text (1.0 / 0.0; case-insensitive,
whole words). A generation with neither is an ``error`` outcome (score 0, the text in its detail).
``reward.judge_verdict: prob``: one left-padded forward, nothing generated; the score is P(yes) / (P(yes) +
P(no)) of the first new token, summed over the vocabulary's tokens that read yes / no (``verdict_tokens``),
in [0, 1]. The prompts' shared head (a few-shot template's examples) is read once in ``prepare`` and its
cache copied into each batch. A hung or slow batch is killed at ``reward.timeout_s`` like any check (a batch
must finish within it), and the pool's outcomes carry each check's wall time, which the reward workers
report (``reward_check_s_total``, ``reward_checks_total`` in ``metrics.jsonl``).

The question travels with the completions when a judge is configured: the rollout worker looks the group's
prompt ids up in the run's dataset (``rollout.agent.PromptTexts``) and puts the text on its reward request
(``RewardRequest.prompt``), the pool passes it to ``judge.batch`` as ``prompts=``. A template that names
``{question}`` with a check that carries none is that check's ``error`` outcome, never a blank question.
Not covered: a judge served by a separate server, sampling the judge, verdicts other than yes/no.

torch and transformers are imported by ``prepare`` in the pool's children only: the reward worker that
builds the pool (and loads this module to check it) never loads them.
"""

from __future__ import annotations

import re
from typing import Optional

from areal_async.data.gym_entry import decode_entry

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


def reference_text(solution: str) -> str:
    """What the judge reads as ``{solution}``: a reasoning-gym entry's oracle answer, else the solution as given."""
    try:
        return str(decode_entry(solution)[1]["answer"])
    except ValueError:
        return solution


def prompt_text(
    tokenizer, template: str, completion: str, solutions: list[str], question: str = "", chat: bool = True
) -> str:
    """The judge's prompt for one completion (the first reference solution), chat-templated when ``chat`` and the
    tokenizer has a chat template."""
    if "{question}" in template and not question:
        raise NoQuestion("the judge's template reads {question} but this check carried no question")
    sol = reference_text(solutions[0] if solutions else "").strip()
    body = template.format(question=question.strip(), completion=completion.strip(), solution=sol)
    if chat and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": body}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return body


def prepare(
    model: str,
    template: str = DEFAULT_TEMPLATE,
    max_new_tokens: int = 4,
    threads: int = 1,
    verdict: str = "text",
    chat: bool = True,
    **_,
) -> None:
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
    _STATE.update(verdict=verdict, chat=chat)
    if verdict == "prob":
        _STATE.update(words=verdict_tokens(tok), head=_head(tok, lm, template, chat))


def verdict_tokens(tok) -> tuple[list[int], list[int]]:
    """The ids of the vocabulary's tokens that read ``yes`` / ``no`` (stripped, any case): ``Yes``, `` no``..."""
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    text = [tok.convert_tokens_to_string([t]).strip().lower() for t in vocab]
    return [i for i, t in enumerate(text) if t == "yes"], [i for i, t in enumerate(text) if t == "no"]


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


def yes_probability(texts: list[str]) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of the judge's first new token after each text (the probabilities of all the
    tokens ``verdict_tokens`` finds, summed), in one left-padded forward; the prompts' shared head (a few-shot
    template's examples) is read once in ``prepare`` and its cache reused when every prompt starts with it."""
    import torch

    tok, lm = _STATE["tok"], _STATE["lm"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    head, cache = _STATE["head"]
    n = len(head) if all(r[: len(head)] == head and len(r) > len(head) for r in rows) else 0
    logp = _last_logprobs(lm, [r[n:] for r in rows], tok.pad_token_id, cache if n else None, n)
    yes, no = _STATE["words"]
    return torch.sigmoid(torch.logsumexp(logp[:, yes], -1) - torch.logsumexp(logp[:, no], -1)).tolist()


def _last_logprobs(lm, rows: list[list[int]], pad: int, cache, n_past: int):
    """Log-probabilities of the token after each row (left-padded), after ``n_past`` cached tokens."""
    import copy

    import torch

    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = (mask.cumsum(-1) - 1).clamp(min=0) + n_past
    past = None
    if cache is not None:
        past = copy.deepcopy(cache)
        past.batch_repeat_interleave(len(rows))
    full = torch.cat([torch.ones(len(rows), n_past, dtype=mask.dtype), mask], dim=1)
    named = {_cache_keyword(lm): past} if past is not None else {}
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=full, position_ids=pos, use_cache=past is not None, **named)
    return torch.log_softmax(out.logits[:, -1].float(), dim=-1)


def _cache_keyword(lm) -> str:
    """``cache`` where the model's forward takes it (newer transformers), else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def _head(tok, lm, template: str, chat: bool):
    """(ids, cache) of what every prompt of ``template`` starts with: its text before the first placeholder, to
    its last line break, less its last token (so a prompt's own tokenization always begins with these ids)."""
    import torch

    mark = "\x00"
    text = prompt_text(tok, template, mark, [mark], mark, chat)
    text = text[: text.index(mark)]
    ids = tok(text[: text.rfind("\n") + 1], add_special_tokens=False)["input_ids"][:-1]
    if not ids:
        return [], None
    with torch.no_grad():
        return ids, lm(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


def judge_batch(completions: list[str], solutions: list[list[str]], prompts: Optional[list[str]] = None, **kwargs):
    """One score (or the ``NoVerdict``/``NoQuestion`` that stands for an error) per completion, from one batched
    generation of those that have a prompt; ``prompts``: each completion's question."""
    prepare(**kwargs)
    questions = prompts if prompts is not None else [""] * len(completions)
    out: list = []
    for c, s, q in zip(completions, solutions, questions):
        try:
            out.append(prompt_text(_STATE["tok"], _STATE["template"], c, s, q, _STATE["chat"]))
        except NoQuestion as e:
            out.append(e)
    todo = [t for t in out if isinstance(t, str)]
    if _STATE["verdict"] == "prob":
        scores = iter(yes_probability(todo) if todo else [])
        return [next(scores) if isinstance(t, str) else t for t in out]
    verdicts = iter(generate(todo) if todo else [])
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
    return {
        "model": cfg.judge,
        "template": cfg.judge_template,
        "max_new_tokens": cfg.judge_max_new_tokens,
        "verdict": cfg.judge_verdict,
        "chat": cfg.judge_chat,
    }
