"""reasoning-gym's scorers as a reward plug-in: ``reward.fn: areal_async.reward.gym_reward:gym_reward``.

The reference solution of a ``train_dataset.type: reasoning_gym`` problem is its reasoning-gym entry as
JSON (``data.gym_entry.encode_entry``: task name, oracle answer, metadata). ``gym_reward`` finds
the completion's final answer (``answers.final_answer``: the last ``<answer>...</answer>``, else the
last ``\\boxed{}``) and hands it, with the entry, to that task's own ``score_answer``. It runs in the
reward pool's killable child processes like math-verify: same ``reward.timeout_s`` (a check past it is
SIGKILLed and scores 0, status 'timeout'), same memory cap, and an exception is status 'error'.

``gym_plain_reward`` reads the answer from plain text instead: the completion's last number (``plain_answer``),
for models that answer in a sentence rather than a box or a tag.

Covered: a completion with no stated answer scores 0.0 (the scorer is not asked); several solutions
score their best; a solution that is not such an entry raises ValueError (status 'error'), naming it.
Not covered: partial-credit rules; whatever the task's scorer returns (reasoning-gym's are in [0, 1])
is the score. reasoning-gym (the 'gym' extra) is imported with this module: ~3 s (it loads matplotlib and
sympy), which a reward child spends at its start (``startup_timeout_s``), never inside a check's timeout.
"""

from __future__ import annotations

import functools

import reasoning_gym  # the 'gym' extra: loaded with this plug-in, inside the pool's startup timeout, not a check's

from areal_async.data.gym_entry import GYM_REWARD_FN, decode_entry, encode_entry
from areal_async.reward.answers import final_answer
from areal_async.reward.plain_answer import last_number

__all__ = ["gym_reward", "gym_plain_reward", "encode_entry", "decode_entry", "GYM_REWARD_FN"]


@functools.cache
def _scorer(task: str):
    return reasoning_gym.get_score_answer_fn(task)


def gym_reward(completion: str, solutions: list[str]) -> float:
    """The best score of the completion's final answer under the task scorer of each solution's entry."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}: {completion!r:.80}")
    if not isinstance(solutions, (list, tuple)) or not solutions:
        raise ValueError(f"solutions must be a non-empty list of reasoning-gym entries, got {solutions!r:.80}")
    entries = [decode_entry(s) for s in solutions]
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    return max(float(_scorer(task)(answer, entry)) for task, entry in entries)


def gym_plain_reward(completion: str, solutions: list[str]) -> float:
    """``gym_reward`` for answers stated in plain text: the completion's last number (``plain_answer.last_number``,
    GSM8K's flexible extract) under each entry's task scorer; 0.0 when it wrote no number."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}: {completion!r:.80}")
    if not isinstance(solutions, (list, tuple)) or not solutions:
        raise ValueError(f"solutions must be a non-empty list of reasoning-gym entries, got {solutions!r:.80}")
    entries = [decode_entry(s) for s in solutions]
    answer = last_number(completion)
    if answer is None:
        return 0.0
    return max(float(_scorer(task)(answer, entry)) for task, entry in entries)
