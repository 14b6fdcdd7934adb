"""Figures from a run's metrics rows (one per trainer step, as in RUN_DIR/metrics.jsonl).

The steady window starts at row ``skip``: it leaves out start-up and the SFT warm-up (both before
step 0) and the first steps, while an async pipeline fills its backlog. A row's ``step_s`` ends at
that row, so per-step means use the rows after ``skip``. ``ideal_limit`` / ``cpu_limit``: the speedup
that overlapping generation with training can reach, from a synchronous run's phase times.
"""

from __future__ import annotations

import statistics
from typing import Optional


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing means over full windows: element i is mean(xs[i : i + window])."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [sum(xs[i : i + window]) / window for i in range(len(xs) - window + 1)]


def time_to_threshold(rows: list[dict], threshold: float, window: int) -> tuple[Optional[int], Optional[float]]:
    """(step, seconds since the end of step 0) where the trailing average of ``reward_mean`` first
    reaches threshold (a full window is required); (None, None) if never."""
    ma = moving_average([r["reward_mean"] for r in rows], window)
    for i, v in enumerate(ma):
        if v >= threshold:
            last = rows[i + window - 1]
            return last["step"], last["wall_s"] - rows[0]["wall_s"]
    return None, None


def steady_window(rows: list[dict], skip: int) -> list[dict]:
    """Rows from ``skip`` on; refuses fewer than 2 of them."""
    if len(rows) < skip + 2:
        raise ValueError(f"need at least {skip + 2} metrics rows (warm-up {skip} + 2), got {len(rows)}")
    return rows[skip:]


def steady_samples_per_s(rows: list[dict], skip: int) -> float:
    """Trained samples per wall second from row `skip` to the last row."""
    w = steady_window(rows, skip)
    dt = w[-1]["wall_s"] - w[0]["wall_s"]
    if dt <= 0:
        raise ValueError(f"wall_s does not increase over the steady window ({w[0]['wall_s']} -> {w[-1]['wall_s']})")
    return (w[-1]["samples_trained_total"] - w[0]["samples_trained_total"]) / dt


def median_samples_per_s(rows: list[dict], skip: int) -> float:
    """Burst-resistant cross-check: median samples per step / median step_s over the window."""
    steps = steady_window(rows, skip)[1:]
    return statistics.median(r["samples_trained"] for r in steps) / statistics.median(r["step_s"] for r in steps)


def phase_times(rows: list[dict], skip: int) -> dict:
    """Mean per-step seconds over the window: ``t_train`` = train_s + ahead_s + publish_s (the
    trainer's step, the part of it run ahead before its plan came, publishing the weights),
    ``t_ahead`` (that part: the only overlap of a synchronous step), ``t_gen`` = step_s - train_s -
    publish_s (the trainer's wait: everything else of a synchronous step), ``t_gen_engine``
    (rollout engines' busy seconds per step, all workers) and ``step_s`` = t_gen + t_train - t_ahead."""
    steps = steady_window(rows, skip)[1:]
    n = len(steps)
    step_s = sum(r["step_s"] for r in steps) / n
    t_ahead = sum(r.get("ahead_s", 0.0) for r in steps) / n  # rows of runs before forward ahead: none
    t_after_plan = sum(r["train_s"] + r["publish_s"] for r in steps) / n
    engine = (steps[-1]["gen_busy_s_total"] - rows[skip]["gen_busy_s_total"]) / n
    return {
        "t_gen": step_s - t_after_plan,
        "t_train": t_after_plan + t_ahead,
        "t_ahead": t_ahead,
        "t_gen_engine": engine,
        "step_s": step_s,
    }


def ideal_limit(t_gen: float, t_train: float, t_ahead: float = 0.0) -> float:
    """Speedup of perfect generation/training overlap over the synchronous step (t_gen + t_train -
    t_ahead, the part of training run ahead already overlapped): that step / max(t_gen, t_train)."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) <= 0 or not 0 <= t_ahead <= t_train:
        raise ValueError(
            f"phase times must be >= 0, not both 0, and 0 <= t_ahead <= t_train; got t_gen={t_gen}, "
            f"t_train={t_train}, t_ahead={t_ahead}"
        )
    return (t_gen + t_train - t_ahead) / max(t_gen, t_train)


def cpu_limit(t_gen: float, t_train: float, cpu_s_per_step: float, n_cores: int, t_ahead: float = 0.0) -> float:
    """The ideal limit with the machine's CPU capacity as a third bound: a step can't take less
    than (all CPU seconds a step needs) / cores."""
    return (t_gen + t_train - t_ahead) / max(t_gen, t_train, cpu_s_per_step / n_cores)
