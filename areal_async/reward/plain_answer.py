"""Answers stated in plain text: the last number of a completion, scored against the reference.

A small instruction-tuned model asked for ``\\boxed{}`` or ``<answer>`` tags rarely writes them
(SmolLM2-135M-Instruct: 0 of 48 arithmetic problems boxed); it answers in a sentence, "The answer is
13." The answer read here is the **last number** of the completion, GSM8K's "flexible extract" (the
last number in the response; lm-evaluation-harness' gsm8k task), with thousands separators dropped
("1,234" is 1234). A completion that rambles past its answer, or is cut by ``max_new_tokens`` in the
middle of working, is judged by whatever number it wrote last: the reward teaches the policy to stop at
its answer.

    plain_answer_reward(completion, solutions)   solutions: plain answers ("13", "-2.5"); 1.0 when the
                                                  last number equals one of them as a number, else 0.0
    gym_reward.gym_plain_reward                  reasoning-gym entries: the last number handed to the task's
                                                  own scorer (reward/gym_reward.py)

Covered: integers and decimals with an optional sign ("-3", "+4", "2.50"), thousands commas between
digit groups. Not covered: fractions, words ("seven"), scientific notation, units; a number inside a
word ("x2") counts as a number.
"""

from __future__ import annotations

import re

__all__ = ["last_number", "plain_answer_reward"]

# a sign only where it cannot be an operator between two numbers ("8-3" is 8 and 3, "= -5" is -5)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?|(?<=\w)\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas between digit groups dropped, a trailing '.' of a
    sentence not part of it), else None."""
    if not isinstance(text, str):
        raise TypeError(f"last_number expects a str, got {type(text).__name__}: {text!r:.80}")
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").lstrip("+") if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def plain_answer_reward(completion: str, solutions: list[str]) -> float:
    """1.0 when the completion's last number equals a solution's number, else 0.0."""
    if not isinstance(solutions, (list, tuple)) or not solutions:
        raise ValueError(f"solutions must be a non-empty list of answers, got {solutions!r:.80}")
    answer = last_number(completion)
    if answer is None:
        return 0.0
    return float(any(_same_number(answer, str(s).replace(",", "").strip()) for s in solutions))
