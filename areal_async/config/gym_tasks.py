"""The ``train_dataset.tasks`` of ``type: reasoning_gym``: a weighted mixture of reasoning-gym tasks.

Each entry is a mapping::

    - name: chain_sum                 # a reasoning-gym task (checked against its registry by the preflight)
      weight: 2                       # > 0; the share of prompts is weight / sum of weights
      config: {max_terms: 2}          # the task's own config fields (its difficulty knobs); seed and size are ours
      levels: [{max_terms: 3}, ...]   # curriculum: level k = config updated by levels[k-1]; level 0 = config

Checked here, without reasoning-gym installed: the shape of every entry and its values, and that
``size`` gives every task at least one problem (``apportion``). A bad entry is a ConfigError naming
``tasks[i].<key>``; the loader puts ``train_dataset.`` in front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_async.config.base import Section, _f, at_least, require, within

__all__ = ["CurriculumConfig", "GymTask", "parse_tasks", "apportion", "RESERVED_KEYS"]

_ENTRY_KEYS = ("name", "weight", "config", "levels")
RESERVED_KEYS = ("seed", "size")  # set by the run for every task: not part of a task's config


@dataclass(frozen=True)
class GymTask:
    name: str
    weight: float
    config: dict
    levels: tuple = ()  # config updates of levels 1, 2, ... (the curriculum)

    @property
    def n_levels(self) -> int:
        return len(self.levels) + 1

    def config_at(self, level: int) -> dict:
        """The task's config at ``level`` (0 = ``config``; k = ``config`` updated by ``levels[k-1]``)."""
        if not 0 <= level < self.n_levels:
            raise ValueError(f"task {self.name!r} has levels 0..{self.n_levels - 1}, not {level}")
        return {**self.config, **(self.levels[level - 1] if level else {})}


def parse_tasks(raw) -> list[GymTask]:
    """The tasks of a ``tasks`` list; ConfigError naming ``tasks[i].<key>`` for the first bad value."""
    require(isinstance(raw, list) and len(raw) > 0, "tasks", raw, "a non-empty list of {name, weight, config}")
    tasks = [_task(i, item) for i, item in enumerate(raw)]
    names = [t.name for t in tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    require(not dupes, "tasks", names, f"each task once (repeated: {', '.join(dupes)})")
    return tasks


def _task(i: int, item) -> GymTask:
    key = f"tasks[{i}]"
    require(isinstance(item, dict), key, item, "a mapping with keys name, weight, config, levels")
    for k in item:
        require(k in _ENTRY_KEYS, f"{key}.{k}", item[k], f"one of the keys {', '.join(_ENTRY_KEYS)}")
    name, weight = item.get("name"), item.get("weight", 1.0)
    require(isinstance(name, str) and name.strip() != "", f"{key}.name", name, "a reasoning-gym task name")
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    require(number and math.isfinite(weight) and weight > 0, f"{key}.weight", weight, "a number > 0")
    config = _knobs(f"{key}.config", item.get("config", {}))
    levels = item.get("levels", [])
    require(isinstance(levels, list), f"{key}.levels", levels, "a list of config updates, one per level above 0")
    steps = tuple(_knobs(f"{key}.levels[{k}]", lv) for k, lv in enumerate(levels))
    return GymTask(name.strip(), float(weight), config, steps)


def _knobs(key: str, value) -> dict:
    require(isinstance(value, dict), key, value, "a mapping of the task's config fields")
    for k in value:
        ok = isinstance(k, str) and k not in RESERVED_KEYS
        require(ok, f"{key}.{k}", value[k], "a field of the task's config (seed and size are train_dataset's)")
    return dict(value)


def apportion(weights: list[float], size: int) -> list[int]:
    """Counts summing to ``size``, count i within one of ``size * w_i / sum(w)`` (largest remainder;
    ties go to the earlier task)."""
    total = sum(weights)
    exact = [size * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class CurriculumConfig(Section):
    """reasoning_gym: raise a task's level (``tasks[i].levels``) once its moving accuracy passes a threshold."""

    threshold: float = _f(
        0.8, "A task moves to its next level when the mean score of its last `window` trained samples is >= this."
    )
    window: int = _f(256, "Trained samples of a task (at its current level) that its moving accuracy is taken over.")

    def check(self) -> None:
        within(self, "threshold", "(0, 1]")
        at_least(self, "window", 1)
