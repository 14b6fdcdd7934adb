"""What the recipe's datasets hold: a prompt and one or more reference solutions (``data/prompts.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    solutions: tuple[str, ...]
    # a completion used by SFT and the warm-up; empty when the dataset has none. A tuple is a tool-use trace:
    # pieces alternating model text, a tool's output (context, not imitated), model text, ..., model text
    answer: str | tuple[str, ...] = ""


def with_instruction(problem: Problem, instruction: str) -> Problem:
    """The problem with ``instruction`` appended to its prompt after a space (``train_dataset.instruction``)."""
    if not instruction:
        return problem
    return Problem(problem.index, f"{problem.prompt} {instruction}", problem.solutions, problem.answer)
