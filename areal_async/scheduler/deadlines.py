"""The group deadlines of the scheduler core: when each running group was issued and when its samples were
all generated, and which groups are past their deadline.

A group not generated within ``rollout.gen_deadline_s`` of its issue (its rollout worker is stuck, or lost
it), or not scored within ``reward.deadline_s`` of its generation (a reward worker died with its request, or
the request was lost), is overdue: the core aborts it with the reason given here and re-issues its prompt
(``SchedulerCore.expire``). 0 turns a deadline off. The same two tables tell ``status.json`` the oldest
open work of each kind (``overdue.open_work``).
"""

from __future__ import annotations

from typing import Callable, Mapping


class Deadlines:
    """Issue and generation times of the running groups (``clock()`` readings), by group id."""

    def __init__(self, clock: Callable[[], float], gen_deadline_s: float, reward_deadline_s: float):
        self.clock, self.gen_s, self.reward_s = clock, gen_deadline_s, reward_deadline_s
        self.issued_at: dict[str, float] = {}  # running group -> clock() at issue
        self.generated_at: dict[str, float] = {}  # running group -> clock() when its last sample was reported

    def issued(self, gid: str) -> None:
        self.issued_at[gid] = self.clock()

    def generated(self, gid: str) -> None:
        """Every sample of ``gid`` is generated: now only its scores are missing (the first report counts)."""
        self.generated_at.setdefault(gid, self.clock())

    def forget(self, gid: str) -> None:
        """``gid`` is no longer running (ready, or aborted)."""
        self.issued_at.pop(gid, None)
        self.generated_at.pop(gid, None)

    def overdue(self, groups: Mapping) -> list[tuple[str, str]]:
        """(group id, why) of every running group past its deadline, in issue order; ``groups``: the ledger's
        records by id. A group no longer running (or no longer known) is forgotten on the way."""
        now, out = self.clock(), []
        for gid, t_issue in list(self.issued_at.items()):
            g = groups.get(gid)
            if g is None or g.status != "running":
                self.forget(gid)
                continue
            t_gen = self.generated_at.get(gid)
            if t_gen is not None and self.reward_s > 0 and now - t_gen > self.reward_s:
                why = f"no score {now - t_gen:.1f}s after generation (reward.deadline_s={self.reward_s:g})"
            elif t_gen is None and self.gen_s > 0 and now - t_issue > self.gen_s:
                why = f"not generated {now - t_issue:.1f}s after issue to {g.worker} "
                why += f"(rollout.gen_deadline_s={self.gen_s:g})"
            else:
                continue
            out.append((gid, f"deadline: {why}"))
        return out
