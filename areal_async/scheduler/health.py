"""Health columns of a metrics row, from the scheduler's own books (no torch).

Per trainer step, over the samples it trained:

    truncated_frac              cut by the generation budget (finish_reason 'length': no EOS)
    completion_len_mean, _p50, _p90, _max   output tokens per sample (nearest-rank percentiles)
    groups_all_zero_frac        groups (one prompt's samples) whose every score is 0: no signal
    groups_all_one_frac         groups whose every score is 1: no signal either
    staleness_at_bound_frac     samples whose staleness (step - oldest token version) is the bound
                                eta (rollout.max_head_offpolicyness): generation ran as far ahead
                                as admission lets it (left out at eta = 0, where every sample is)
    trainer_idle_frac           1 - (train_s + publish_s) / step_s: the share of the step's wall
                                time the trainer spent neither training nor publishing
    rollout_idle_frac, reward_idle_frac
                                1 - busy seconds / (workers x wall seconds) of the role, over the
                                trailing IDLE_WINDOW_S of rows (busy seconds come with heartbeats,
                                so a single step's change is too coarse to read)
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from operator import attrgetter, countOf
from typing import Iterable, Optional, Sequence

_VMIN = attrgetter("version_min")
IDLE_WINDOW_S = 20.0  # >= several heartbeats (cluster.heartbeat_s, 2 s by default)


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The ``ceil(q n)``-th smallest of already sorted values."""
    return float(sorted_values[max(1, math.ceil(q * len(sorted_values))) - 1])


def sample_health(trained: Iterable, step: int, eta: int) -> dict[str, float]:
    """Truncation, lengths, group reward spread and staleness at the bound of step ``step``'s trained
    ``SampleRecord``s."""
    recs = list(trained)
    if not recs:
        return {}
    lengths = sorted(map(attrgetter("n_output_tokens"), recs))
    at_bound = step - eta  # staleness step - version_min >= eta: version_min <= step - eta
    row = {} if eta <= 0 else {"staleness_at_bound_frac": sum(v <= at_bound for v in map(_VMIN, recs)) / len(recs)}
    row |= {
        "truncated_frac": countOf(map(attrgetter("finish_reason"), recs), "length") / len(recs),
        "completion_len_mean": sum(lengths) / len(lengths),
        "completion_len_p50": nearest_rank(lengths, 0.5),
        "completion_len_p90": nearest_rank(lengths, 0.9),
        "completion_len_max": float(lengths[-1]),
    }
    return row | group_spread(recs)


def group_spread(recs: Sequence) -> dict[str, float]:
    """The groups (samples by ``group_id``, scored ones) whose every score is 0, and those whose every one is 1."""
    groups: dict[str, list[float]] = defaultdict(list)
    for gid, score in zip(map(attrgetter("group_id"), recs), map(attrgetter("score"), recs)):
        if score is not None:
            groups[gid].append(score)
    if not groups:
        return {}
    n = len(groups)
    return {  # countOf compares with ==, as float(score) == 0.0 did (an int 0 or a bool False counts)
        "groups_all_zero_frac": sum(countOf(g, 0.0) == len(g) for g in groups.values()) / n,
        "groups_all_one_frac": sum(countOf(g, 1.0) == len(g) for g in groups.values()) / n,
    }


def trainer_idle(metrics: dict, step_s: float) -> Optional[float]:
    """1 - (train_s + publish_s) / step_s, within [0, 1]; None without the trainer's times."""
    if "train_s" not in metrics or step_s <= 0:
        return None
    busy = float(metrics["train_s"]) + float(metrics.get("publish_s", 0.0))
    return min(1.0, max(0.0, 1.0 - busy / step_s))


class IdleMeter:
    """A role's idle fraction over a trailing window of (wall time, workers, busy seconds in total)."""

    def __init__(self, window_s: float = IDLE_WINDOW_S):
        self.window_s = window_s
        self.points: deque[tuple[float, int, float]] = deque()

    def add(self, wall_s: float, n_workers: int, busy_total_s: float) -> Optional[float]:
        """Record a row's point; the idle fraction since the oldest point within the window (None:
        no span yet, no workers, or a busy total that fell: a worker restarted and counts from 0)."""
        if self.points and busy_total_s < self.points[-1][2]:
            self.points.clear()
        self.points.append((wall_s, n_workers, busy_total_s))
        while len(self.points) > 2 and wall_s - self.points[1][0] >= self.window_s:
            self.points.popleft()
        t0, _, b0 = self.points[0]
        if wall_s <= t0 or n_workers <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - (busy_total_s - b0) / (n_workers * (wall_s - t0))))
