"""Training prompts: the generated tiny arithmetic task, jsonl datasets, and a checkpointable cursor.

A ``Problem`` is what the recipe's datasets hold: a prompt and one or more reference
solutions (boba-106k lines are ``{"prompt": ..., "solutions": [...]}``). ``PromptCursor`` walks
a seeded permutation epoch after epoch and its whole position is two integers, so a
checkpoint can store it and a resumed run continues with the same next prompt.

The tiny task (``tiny_arith``): ``"3+4="`` -> reference ``"7"``; a correct completion is
``\\boxed{7}``. Its reward goes through math-verify like any other dataset's. Prompt templates
(``train_dataset.template``: none | chat | r1) live in ``templates.py``; ``prompt_encoder`` applies
them, for every caller. ``keep_short`` is the seed's ``max_prompt_len`` filter.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from areal_async.config import DatasetConfig
from areal_async.data.gym import gym_problems
from areal_async.data.problem import Problem, with_instruction
from areal_async.data.templates import render_prompt_ids, render_prompt_text


def tiny_arith(cfg: DatasetConfig, seed: int) -> list[Problem]:
    """All distinct ``a op b`` problems over 0..max_operand, shuffled, first ``size`` kept.

    Reference answers (for SFT) are zero-padded to one width (``\\boxed{07}``; math-verify
    reads it as 7): when answer length tracks difficulty (one digit = small sums), the groups
    that finish first in an asynchronous fleet are the easy ones, and early batches are biased.
    """
    rng = random.Random(seed)
    items = [(a, op, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1) for op in cfg.ops]
    rng.shuffle(items)
    values = [a + b if op == "+" else a - b if op == "-" else a * b for a, op, b in items[: cfg.size]]
    width = len(str(max(abs(v) for v in values)))
    tools = random.Random(seed + 1)  # its own stream: tool_share leaves the problems and their order alone
    out = []
    for i, ((a, op, b), value) in enumerate(zip(items, values)):
        shown = f"{value:0{width}d}" if value >= 0 else str(value)
        answer = f"\\boxed{{{shown}}}"
        if tools.random() < cfg.tool_share:  # the calculator's trace: call, the tool's result, the answer
            answer = (f"<<{a}{op}{b}=", f"{value}>>", f"\\boxed{{{value}}}")
        out.append(Problem(i, f"{a}{op}{b}=", (str(value),), answer))
    return out


def load_jsonl(path: str | Path) -> list[Problem]:
    """Lines of {"prompt": str, "solutions": [str, ...]}; a bad line is an error naming it."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(_problem_from_json(line, lineno, path, len(out)))
    if not out:
        raise ValueError(f"{path}: no problems found")
    return out


def read_jsonl_head(path: str | Path, n: int = 5) -> list[tuple[int, Problem]]:
    """(line number, problem) of the first ``n`` problems of a training jsonl, as ``load_jsonl`` reads
    them (blank lines skipped); a bad line is a ValueError naming ``FILE:LINE``, an empty file one too."""
    out: list[tuple[int, Problem]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                out.append((lineno, _problem_from_json(line, lineno, path, len(out))))
            if len(out) >= n:
                break
    if not out:
        raise ValueError(f"{path}: no problems found")
    return out


def _problem_from_json(line: str, lineno: int, path: str | Path, index: int) -> Problem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
    prompt, sols = (obj.get("prompt"), obj.get("solutions")) if isinstance(obj, dict) else (None, None)
    sols_ok = isinstance(sols, list) and sols and all(isinstance(s, str) for s in sols)
    if not isinstance(prompt, str) or not sols_ok:
        raise ValueError(f'{path}:{lineno}: expected {{"prompt": str, "solutions": [str, ...]}}')
    return Problem(index, prompt, tuple(sols), _answer(obj.get("answer", ""), lineno, path))


def _answer(answer, lineno: int, path: str | Path) -> str | tuple[str, ...]:
    """A jsonl line's optional "answer": a string, or a tool-use trace as an odd-length list of strings
    (model text, tool output, ..., model text); anything else is an error naming the line."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, list) and len(answer) % 2 == 1 and all(isinstance(x, str) for x in answer):
        return tuple(answer)
    raise ValueError(
        f'{path}:{lineno}: "answer" must be a string or an odd-length list of strings (model text, tool output, '
        f"..., model text), got {str(answer)[:60]}"
    )


def load_problems(cfg: DatasetConfig, seed: int) -> list[Problem]:
    """The dataset's problems, each prompt followed by ``cfg.instruction`` when one is set."""
    if cfg.type == "reasoning_gym":
        return gym_problems(cfg, seed)  # imports reasoning-gym (the 'gym' extra) only now; instructed there
    problems = tiny_arith(cfg, seed) if cfg.type == "tiny_arith" else load_jsonl(cfg.path)
    return [with_instruction(p, cfg.instruction) for p in problems]


def split_holdout(problems: list[Problem], n: int) -> tuple[list[int], list[Problem]]:
    """(indices of the training problems, the held-out problems) for ``train_dataset.holdout`` = ``n``: the
    last ``n`` distinct prompts, walking back from the end, are held out (in their order), and no training
    problem has a held-out prompt (a generator may repeat one). ValueError when fewer than ``n`` distinct
    prompts exist or none would be left to train on."""
    if n == 0:
        return list(range(len(problems))), []
    held: dict[str, int] = {}
    for i in range(len(problems) - 1, -1, -1):
        if len(held) == n:
            break
        held.setdefault(problems[i].prompt, i)
    train = [i for i, p in enumerate(problems) if p.prompt not in held]
    if len(held) < n or not train:
        raise ValueError(
            f"train_dataset.holdout={n}: the {len(problems)} problems hold {len(set(p.prompt for p in problems))} "
            "distinct prompts; expected more than holdout (some left to train on)"
        )
    return train, [problems[i] for i in sorted(held.values())]


def training_problems(cfg: DatasetConfig, seed: int) -> tuple[list[Problem], list[int]]:
    """(every problem, the indices of those trained on: all but the held-out ones, ``split_holdout``)."""
    problems = load_problems(cfg, seed)
    return problems, split_holdout(problems, cfg.holdout)[0]


class PromptCursor:
    """Seeded epoch-by-epoch walk over problems; state = (epoch, position)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, epoch: int = 0, position: int = 0):
        if n < 1:
            raise ValueError(f"PromptCursor needs at least one problem, got {n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, str]:
        """(problem index, prompt id) of the next prompt; prompt ids are unique per run."""
        if self.position >= self.n:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.position]
        self.position += 1
        return idx, f"e{self.epoch}p{self.position - 1}"

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, n: int, seed: int, shuffle: bool, state: dict) -> "PromptCursor":
        return cls(n, seed, shuffle, int(state["epoch"]), int(state["position"]))


def prompt_encoder(tokenizer, template: str):
    """prompt text -> token ids under ``template`` (see templates.py): how RL, SFT and evaluation
    tokenize a prompt. A template the tokenizer cannot render is refused here, before any prompt."""
    render_prompt_text(tokenizer, "", template)  # fail now: e.g. 'chat' with a tokenizer that has no template
    return lambda text: render_prompt_ids(tokenizer, text, template)


@dataclass
class LengthFilter:
    """What ``keep_short`` kept: indices into the problem list, and the longest prompt dropped."""

    kept: list[int]
    n_total: int
    max_prompt_len: int
    longest_dropped: int = 0

    @property
    def n_dropped(self) -> int:
        return self.n_total - len(self.kept)

    def describe(self) -> str:
        return (
            f"{self.n_total} prompts, {self.n_dropped} longer than max_prompt_len={self.max_prompt_len} tokens "
            f"filtered out (longest {self.longest_dropped}), {len(self.kept)} kept"
        )


def keep_short(problems: list[Problem], encode, max_prompt_len: int, among: list[int] | None = None) -> LengthFilter:
    """The seed's filter: problems (those at the indices ``among``, default all) whose encoded prompt has
    at most ``max_prompt_len`` tokens. Raises ``ValueError`` when none is left (naming the limit and the
    shortest prompt)."""
    among = list(range(len(problems))) if among is None else among
    lengths = {i: len(encode(problems[i].prompt)) for i in among}
    kept = [i for i in among if lengths[i] <= max_prompt_len]
    if not kept:
        raise ValueError(
            f"train_dataset.max_prompt_len={max_prompt_len}: every one of the {len(among)} prompts "
            f"is longer (shortest {min(lengths.values(), default=0)} tokens after the template)"
        )
    dropped = [n for n in lengths.values() if n > max_prompt_len]
    return LengthFilter(kept, len(among), max_prompt_len, max(dropped, default=0))


def sft_examples(problems: list[Problem], tokenizer, template: str) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, answer ids + eos, answer mask) for every problem that has an answer (SFT and warm-up).
    A tool-use trace's pieces are tokenized one by one, as a tool loop builds its episode; its tool outputs
    get mask 0 (context the model reads, not text it imitates)."""
    enc = prompt_encoder(tokenizer, template)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for p in (p for p in problems if p.answer):
        pieces = (p.answer,) if isinstance(p.answer, str) else p.answer
        ids, mask = [], []
        for k, piece in enumerate(pieces):
            piece_ids = tokenizer.encode(piece, add_special_tokens=False)
            ids, mask = ids + piece_ids, mask + [1 - k % 2] * len(piece_ids)
        out.append((enc(p.prompt), ids + eos, mask + [1] * len(eos)))
    return out
