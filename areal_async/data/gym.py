"""reasoning-gym as a data source (``train_dataset.type: reasoning_gym``): a weighted mixture of its tasks.

``size`` problems in all are split among the tasks by weight (``apportion``: each count within one of
size * weight / sum of weights) and laid out interleaved (``interleave``: every prefix of the layout
holds each task within one problem of its share), so an epoch of the prompt cursor gives each task
exactly its count and a shuffled epoch's prefix follows the weights up to sampling noise.

Slot i holds problem ``local`` of its task ``t``: item ``local`` of reasoning-gym's
``create_dataset(name, **config_at(level), seed=s(t, level), size=count_t)``, made on demand (items
are addressable: reasoning-gym seeds each item from seed + index). The curriculum raises a task's
``level`` (``set_level``); its slots then hold that level's items. Each problem's reference solution is
its entry as JSON (``gym_entry.encode_entry``) and its SFT answer the oracle answer boxed; its prompt is the
question followed by ``train_dataset.instruction``, when one is set.

reasoning-gym is the optional 'gym' extra, imported when the first dataset is made (``require_gym``
raises one line saying how to install it).
"""

from __future__ import annotations

from areal_async.config import DatasetConfig
from areal_async.config.gym_tasks import GymTask, apportion, parse_tasks
from areal_async.data.gym_entry import encode_entry
from areal_async.data.problem import Problem, with_instruction

__all__ = ["GymSource", "interleave", "require_gym", "gym_problems", "GYM_INSTALL"]

GYM_INSTALL = "pip install -e '.[gym]' (or pip install reasoning-gym)"


def require_gym():
    """The ``reasoning_gym`` module; ImportError with the install line when the extra is missing."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"type reasoning_gym needs the reasoning-gym package: {GYM_INSTALL} ({e})") from e
    return reasoning_gym


def interleave(counts: list[int]) -> list[tuple[int, int]]:
    """(task, local index) per slot: task t's j-th problem sits at position (j + 1/2) / counts[t] of the
    layout (ties by task), so every prefix holds each task within one of its share."""
    keyed = [((j + 0.5) / n, t, j) for t, n in enumerate(counts) for j in range(n)]
    return [(t, j) for _, t, j in sorted(keyed)]


class GymSource:
    """The mixture's problems, slot by slot, each task at its current curriculum level."""

    def __init__(self, tasks: list[GymTask], size: int, seed: int, instruction: str = ""):
        self.tasks, self.seed, self.instruction = tasks, seed, instruction
        self.counts = apportion([t.weight for t in tasks], size)
        self.slots = interleave(self.counts)
        self.levels = [0] * len(tasks)
        self._datasets: dict[tuple[int, int], object] = {}

    @classmethod
    def from_config(cls, cfg: DatasetConfig, seed: int) -> "GymSource":
        return cls(parse_tasks(cfg.tasks), cfg.size, seed, cfg.instruction)

    def __len__(self) -> int:
        return len(self.slots)

    def task_of(self, slot: int) -> int:
        return self.slots[slot][0]

    def problem(self, slot: int) -> Problem:
        t, local = self.slots[slot]
        entry = self.dataset(t, self.levels[t])[local]
        name = self.tasks[t].name
        problem = Problem(slot, entry["question"], (encode_entry(name, entry),), f"\\boxed{{{entry['answer']}}}")
        return with_instruction(problem, self.instruction)

    def problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(len(self.slots))]

    def set_level(self, t: int, level: int) -> None:
        self.tasks[t].config_at(level)  # ValueError past the task's last level
        self.levels[t] = level

    def dataset(self, t: int, level: int):
        """reasoning-gym's dataset of task ``t`` at ``level`` (made once)."""
        key = (t, level)
        if key not in self._datasets:
            task = self.tasks[t]
            seed = (self.seed * 1_000_003 + t * 10_007 + level * 101) % (1 << 31)
            rg = require_gym()
            self._datasets[key] = rg.create_dataset(task.name, **task.config_at(level), seed=seed, size=self.counts[t])
        return self._datasets[key]


def gym_problems(cfg: DatasetConfig, seed: int) -> list[Problem]:
    """Every problem of the mixture at level 0 (SFT, the warm-up, evaluation)."""
    return GymSource.from_config(cfg, seed).problems()
