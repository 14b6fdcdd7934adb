"""Admission hands each new group to the rollout worker holding the fewest groups, ties to the lowest id:
checked against a brute-force replay of that rule over random loads and fleet sizes."""

import random

from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams


def _core(n_workers: int, loads: list[int], batch: int) -> SchedulerCore:
    params = SchedulerParams(batch_size=batch, n_samples=2, eta=3, total_steps=100, max_concurrent=10_000, gen={})
    core = SchedulerCore(params, PromptCursor(50, seed=1), lambda i: ([1, i], [str(i)]))
    for w in random.Random(n_workers).sample(range(n_workers), n_workers):  # registered in a shuffled order
        core.add_rollout(f"rollout-{w:03d}")
    for w, k in enumerate(loads):  # groups already running there (only their number matters to the choice)
        core.rollouts[f"rollout-{w:03d}"].groups.update(f"x{w}-{j}" for j in range(k))
    core.on_trainer_ready(0, 0)
    return core


def _replay(loads: list[int], n: int) -> list[str]:
    """The rule, one group at a time: scan every worker for (fewest groups, lowest id)."""
    held, out = {f"rollout-{w:03d}": k for w, k in enumerate(loads)}, []
    for _ in range(n):
        wid = min(held, key=lambda w: (held[w], w))
        held[wid] += 1
        out.append(wid)
    return out


def test_each_group_goes_to_the_least_loaded_worker_lowest_id_first():
    rng = random.Random(40)
    for _ in range(200):
        n_workers = rng.choice([1, 2, 3, 7, 64])
        loads = [rng.randint(0, 6) for _ in range(n_workers)]
        core = _core(n_workers, loads, batch=rng.randint(1, 40))
        admitted = [wid for wid, *_ in core._admitted(only_short=False)]
        budget = (3 + 0 + 1) * core.p.batch_size - sum(loads)  # eta 3 at version 0, nothing accepted yet
        assert len(admitted) == max(0, budget)
        assert admitted == _replay(loads, len(admitted))
