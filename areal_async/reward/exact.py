"""Exact-match reward for tasks whose answer is the whole completion (no ``\\boxed{}``).

Covered: ``exact_match_reward`` (1.0 when the completion, stripped of surrounding whitespace,
equals one of the reference solutions, stripped; else 0.0). Cheap on purpose: the overhead
benchmark's tiny a+b task has a 16-token vocabulary with no room for ``\\boxed``.
Not covered: numeric equivalence (``07`` vs ``7``) or any normalisation beyond whitespace;
use ``math_verify_reward`` for that.
"""

from __future__ import annotations

__all__ = ["exact_match_reward"]


def exact_match_reward(completion: str, solutions: list[str]) -> float:
    """1.0 if ``completion.strip()`` equals any ``solution.strip()``, else 0.0."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}: {completion!r:.80}")
    if not isinstance(solutions, (list, tuple)) or not solutions or not all(isinstance(s, str) for s in solutions):
        raise ValueError(f"solutions must be a non-empty list of str, got {solutions!r:.80}")
    answer = completion.strip()
    return 1.0 if any(answer == s.strip() for s in solutions) else 0.0
