"""The scheduler's prompts by index, and for a reasoning-gym mixture its books per task: per-step reward
per task in every metrics row, and the curriculum.

``PromptTable``: problem index -> (prompt token ids, solutions), encoded once (again after a curriculum
level change replaced the problem); it notes the level each index was last issued at.

``Curriculum``: per task, the level and the scores of its last ``window`` trained samples issued at
that level; ``due(t)`` once the window is full and its mean >= ``threshold``; ``advance(t)`` moves up
one level and empties the window. Pure: no reasoning-gym, no clock.

``TaskBook``: ties them to the mixture (``data.gym.GymSource``): ``step_row(trained)`` books the step's
trained samples per task and returns the metrics columns::

    task/<name>/reward_mean     mean score of the task's samples trained this step (absent when none)
    task/<name>/samples         samples of the task trained this step
    task/<name>/samples_total   ... since the start of the run
    task/<name>/level           its curriculum level (tasks with levels only)
    task/<name>/accuracy_ma     mean score of its window (tasks with levels, once a sample is in it)
    task/<name>/level_raised    1 on the step the task moved up a level

A level whose prompts do not all fit ``train_dataset.max_prompt_len`` is not taken: the task stays,
logged once (``task/<name>/level_capped`` 1 from then on). State for a checkpoint: ``state`` / ``restore``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Optional

log = logging.getLogger("areal_async.scheduler")


class PromptTable:
    """Problem index -> (prompt ids, solutions), encoded on first use."""

    def __init__(self, problems: list, tokenize: Callable[[str], list[int]], level_of: Callable[[int], int]):
        self.problems, self.tokenize, self.level_of = problems, tokenize, level_of
        self.encoded: dict[int, tuple[list[int], list[str]]] = {}
        self.issued_level: dict[int, int] = {}  # index -> level of the prompt last issued for it

    def __call__(self, idx: int) -> tuple[list[int], list[str]]:
        if idx not in self.encoded:
            p = self.problems[idx]
            self.encoded[idx] = (self.tokenize(p.prompt), list(p.solutions))
        self.issued_level[idx] = self.level_of(idx)
        return self.encoded[idx]

    def replace(self, idx: int, problem) -> None:
        self.problems[idx] = problem
        self.encoded.pop(idx, None)


class Curriculum:
    """Levels and moving windows of scores, per task (see the module docstring)."""

    def __init__(self, n_levels: list[int], threshold: float, window: int):
        self.n_levels, self.threshold, self.window = list(n_levels), threshold, window
        self.levels = [0] * len(n_levels)
        self.capped = [False] * len(n_levels)
        self.scores = [deque(maxlen=window) for _ in n_levels]

    def record(self, t: int, score: float) -> None:
        self.scores[t].append(float(score))

    def accuracy(self, t: int) -> Optional[float]:
        s = self.scores[t]
        return sum(s) / len(s) if s else None

    def due(self, t: int) -> bool:
        top = self.levels[t] + 1 >= self.n_levels[t]
        full = len(self.scores[t]) == self.window
        return not top and not self.capped[t] and full and self.accuracy(t) >= self.threshold

    def advance(self, t: int) -> int:
        self.levels[t] += 1
        self.scores[t].clear()
        return self.levels[t]

    def state(self) -> dict:
        return {"levels": list(self.levels), "capped": list(self.capped), "scores": [list(s) for s in self.scores]}

    def restore(self, state: dict) -> None:
        self.levels = [int(x) for x in state["levels"]]
        self.capped = [bool(x) for x in state["capped"]]
        self.scores = [deque((float(x) for x in s), maxlen=self.window) for s in state["scores"]]


class TaskBook:
    """Per-task metrics and the curriculum of a reasoning-gym mixture (see the module docstring)."""

    def __init__(self, source, kept: list[int], problems: list, tokenize, max_prompt_len: int, curriculum):
        """``kept``: the source's slots within max_prompt_len, in problem-index order, and ``problems``
        theirs; ``curriculum``: the ``train_dataset.curriculum`` section (threshold, window)."""
        self.source, self.kept, self.tokenize, self.max_prompt_len = source, kept, tokenize, max_prompt_len
        self.names = [t.name for t in source.tasks]
        self.task = [source.task_of(slot) for slot in kept]  # problem index -> task
        self.curriculum = Curriculum([t.n_levels for t in source.tasks], curriculum.threshold, curriculum.window)
        self.table = PromptTable(list(problems), tokenize, self.level_of)
        self.totals = [0] * len(self.names)

    def level_of(self, idx: int) -> int:
        return self.curriculum.levels[self.task[idx]]

    def step_row(self, trained: list) -> dict:
        """Book the step's trained samples (records with ``problem_index`` and ``score``); its columns."""
        row: dict = {}
        for t, name in enumerate(self.names):
            mine = [r for r in trained if self.task[r.problem_index] == t]
            self.totals[t] += len(mine)
            row[f"task/{name}/samples"] = len(mine)
            row[f"task/{name}/samples_total"] = self.totals[t]
            if mine:
                row[f"task/{name}/reward_mean"] = sum(r.score or 0.0 for r in mine) / len(mine)
            if self.curriculum.n_levels[t] > 1:
                row.update(self._curriculum_columns(t, name, mine))
        return row

    def _curriculum_columns(self, t: int, name: str, mine: list) -> dict:
        c = self.curriculum
        for r in mine:
            if self.table.issued_level.get(r.problem_index, 0) == c.levels[t]:
                c.record(t, r.score or 0.0)
        raised = c.due(t) and self._raise(t)
        out = {f"task/{name}/level": c.levels[t], f"task/{name}/level_raised": int(raised)}
        if c.accuracy(t) is not None:
            out[f"task/{name}/accuracy_ma"] = c.accuracy(t)
        if c.capped[t]:
            out[f"task/{name}/level_capped"] = 1
        return out

    def _raise(self, t: int) -> bool:
        """Move task ``t`` one level up, its prompts replaced; False (capped) when one is too long."""
        c, level = self.curriculum, self.curriculum.levels[t] + 1
        acc = c.accuracy(t)
        if not self._set_level(t, level):
            c.capped[t] = True
            return False
        c.advance(t)
        log.info("curriculum: task %s moved to level %d (moving accuracy %.3f)", self.names[t], level, acc)
        return True

    def _set_level(self, t: int, level: int) -> bool:
        old = self.source.levels[t]
        self.source.set_level(t, level)
        idxs = [i for i, task in enumerate(self.task) if task == t]
        new = {i: self.source.problem(self.kept[i]) for i in idxs}
        longest = max((len(self.tokenize(p.prompt)) for p in new.values()), default=0)
        if longest > self.max_prompt_len:
            self.source.set_level(t, old)
            log.warning(
                "curriculum: task %s stays at level %d: a level-%d prompt has %d tokens > max_prompt_len=%d",
                self.names[t],
                old,
                level,
                longest,
                self.max_prompt_len,
            )
            return False
        for i, p in new.items():
            self.table.replace(i, p)
        return True

    def state(self) -> dict:
        return {"curriculum": self.curriculum.state(), "totals": list(self.totals)}

    def restore(self, state: Optional[dict]) -> None:
        """Continue from a checkpoint's state (None: a checkpoint of a run before these books)."""
        if not state:
            return
        self.curriculum.restore(state["curriculum"])
        self.totals = [int(x) for x in state["totals"]]
        for t, level in enumerate(self.curriculum.levels):
            if level and not self._set_level(t, level):
                raise ValueError(f"checkpoint: task {self.names[t]} at level {level} no longer fits max_prompt_len")
