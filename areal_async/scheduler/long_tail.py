"""The long tail: ``rollout.over_provision`` (APRIL's over-provisioning, on our staleness bound) and the books
of the two columns it moves, ``tail_s`` and ``wasted_tokens``.

Over-provisioning (F > 0, E = ceil(F * B) extra groups)::

    admission    accepted + running < (eta + v + 1) B + E, and only while accepted < (eta + v + 1) B
                 (staleness.admission_budget with extra=E; E = 0 is today's rule exactly)
    the bound    accepted reaches (eta + v + 1) B: every group still running is a straggler. It could only
                 be accepted beyond the bound, i.e. trained at a step >= v + eta + 1, which needs an oldest
                 token of version >= v + 1, and its tokens are of version <= v: the staleness rule would drop
                 it. It is aborted now ("straggler: ..."), its rollout worker stops it (AbortGroups), its
                 prompt is re-issued ahead of new ones (counting toward rollout.max_reissues), and what it
                 had generated is booked as wasted.

So a batch is the first (eta + v + 1) B groups to finish, the slowest E of each round are cut, and no group is
started that the bound would drop; at eta = 0 the trainer stops waiting for the slowest groups of its batch.
APRIL (arXiv 2509.18521) resumes the partial samples in a later round; here the partial tokens are of a
version the staleness rule would reject in any later step (eta = 0) or that would make the sample the oldest
of its batch, so the prompt is re-issued whole instead.

Columns (per step row): ``tail_s``: for a batch planned while the trainer waited, how long its last group to
finish kept the trainer waiting after the one before it: max(0, t_last - max(t_second_last, t_trainer_free));
0 for a batch planned ahead (the trainer was busy). ``wasted_tokens``: output tokens generated and never
trained since the last row: samples aborted after generation (stale, dynamic filter, lost trajectories,
skipped optimizer steps), partial samples stopped by their engine (``GroupsStopped``), and late trajectories
of groups already aborted.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable


def extra_groups(over_provision: float, batch_size: int) -> int:
    """E = ceil(F * B): the groups that may run beyond the staleness budget."""
    if over_provision < 0:
        raise ValueError(f"over_provision={over_provision!r}: expected >= 0")
    return math.ceil(over_provision * batch_size - 1e-9)


def straggler_reason(accepted: int, bound: int, version: int, eta: int, over_provision: float) -> str:
    return (
        f"straggler: {accepted} groups accepted, the bound (eta + v + 1) B = {bound} at version {version}, "
        f"eta {eta}; still running, it could be trained only at a step >= {version + eta + 1}, which needs "
        f"tokens of version >= {version + 1} (rollout.over_provision={over_provision:g}); prompt re-issued"
    )


class LongTail:
    """Ready times of the groups waiting to be planned, the trainer's idle start, each step's tail_s, and the
    cumulative wasted tokens (the step rows take the difference)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.ready_at: dict[str, float] = {}
        self.trainer_free_at = clock()
        self.tail_s: dict[int, float] = {}  # step -> its tail, until the step's row takes it
        self.wasted = 0

    def ready(self, gid: str) -> None:
        self.ready_at[gid] = self.clock()

    def forget(self, gid: str) -> None:
        self.ready_at.pop(gid, None)

    def trainer_free(self) -> None:
        self.trainer_free_at = self.clock()

    def planned(self, step: int, gids: Iterable[str], waited: bool) -> None:
        """The batch of ``step`` planned; ``waited``: the trainer was idle (not planned ahead)."""
        times = sorted(self.ready_at.pop(g, self.trainer_free_at) for g in gids)
        if not waited or not times:
            self.tail_s[step] = 0.0
            return
        before = max(times[-2] if len(times) > 1 else self.trainer_free_at, self.trainer_free_at)
        self.tail_s[step] = max(0.0, times[-1] - before)

    def take_tail(self, step: int) -> float:
        return self.tail_s.pop(step, 0.0)
