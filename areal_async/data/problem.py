"""What the recipe's datasets hold: a prompt and one or more reference solutions (``data/prompts.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    solutions: tuple[str, ...]
    answer: str = ""  # a completion used by the SFT warm-up; empty when the dataset has none


def with_instruction(problem: Problem, instruction: str) -> Problem:
    """The problem with ``instruction`` appended to its prompt after a space (``train_dataset.instruction``)."""
    if not instruction:
        return problem
    return Problem(problem.index, f"{problem.prompt} {instruction}", problem.solutions, problem.answer)
