"""The per-prompt pass-rate memory (``rollout.skip_solved_after: k``): prompts settled by their last k groups
are not issued again.

A prompt's *appearance* is one of its groups, counted when its last sample is scored (whatever happens
to the group next: trained, dropped by ``rollout.dynamic_filter``, aborted as stale). An appearance is
*uniform* when every sample got the same reward. A prompt is *settled* once its last k appearances were
uniform with the same reward: solved by every sample k times in a row, or failed by every sample k
times in a row (one reward that differs between samples, or a different shared reward, starts the
count again). Each appearance of a settled prompt would have had zero advantage under a group
baseline (``nonzero_std`` drops it): skipping it saves its generation.

The memory keeps, per prompt on a streak, (the shared reward, appearances in a row): O(1) a prompt,
nothing for prompts whose last group was mixed. The scheduler (``SchedulerCore._next_prompt``) asks
``settled`` for each prompt the cursor yields and passes over a settled one before any group is
issued: the admission count (accepted + running) never sees it, so η's bound is unchanged.
A settled prompt can come back: a group of it still in flight when it settled may end mixed.

Books: ``skipped_draws`` (cursor draws passed over), ``settled_new`` (problem indices settled since
the caller last took them: the metrics row names them), ``state()`` / ``restore()`` for a checkpoint.
Anchor: open-instruct's ``no_resampling_pass_rate`` excludes a prompt whose pass rate in one appearance
reaches a threshold (high pass rates only, for good); this memory judges k appearances, both ends.
"""

from __future__ import annotations

from typing import Sequence


class PromptMemory:
    """Streaks of uniform rewards per problem index; see the module docstring."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"rollout.skip_solved_after={k}: a PromptMemory needs k >= 1 (0 = off: no memory)")
        self.k = k
        self.streak: dict[int, tuple[float, int]] = {}  # problem index -> (shared reward, uniform groups in a row)
        self.settled_set: set[int] = set()
        self.skipped_draws = 0
        self.settled_new: list[int] = []

    def record(self, idx: int, scores: Sequence[float]) -> None:
        """One scored group of problem ``idx`` (its samples' rewards, in any order)."""
        if not scores or max(scores) > min(scores):
            self.streak.pop(idx, None)
            self.settled_set.discard(idx)
            return
        reward = float(scores[0])
        shared, run = self.streak.get(idx, (None, 0))
        run = run + 1 if shared == reward else 1
        self.streak[idx] = (reward, run)
        if run >= self.k:
            if idx not in self.settled_set:
                self.settled_new.append(idx)
            self.settled_set.add(idx)
        else:
            self.settled_set.discard(idx)

    def draw(self, cursor) -> tuple[int, str]:
        """The ``PromptCursor``'s next (index, prompt id) that is not settled; each settled one drawn on the
        way is counted and passed over. The caller checks ``all_settled`` first: then an unsettled prompt
        comes within the rest of this epoch and the next one, 2n draws."""
        for _ in range(2 * cursor.n + 1):
            idx, prompt_id = cursor.next()
            if idx not in self.settled_set:
                return idx, prompt_id
            self.skipped_draws += 1
        raise RuntimeError(f"no unsettled prompt in {2 * cursor.n + 1} draws of {cursor.n} (a bug: see all_settled)")

    def all_settled(self, n: int) -> bool:
        """Every one of the cursor's ``n`` prompts is settled (``draw`` would find none)."""
        return len(self.settled_set) >= n

    def exhausted(self, n: int, step: int, ready: int, batch_size: int) -> str:
        """Why the run stops when every prompt is settled and nothing in flight can unsettle one."""
        return (
            f"rollout.skip_solved_after={self.k}: all {n} prompts are settled (every sample got the same reward in "
            f"each of their last {self.k} groups: solved, or failed, by all), nothing is in flight and step {step} "
            f"has {ready} of {batch_size} groups; use harder (or easier) data, more samples per prompt, or a larger "
            "k (0 = off)"
        )

    def take_new(self) -> list[int]:
        """Problem indices that settled since the last call (sorted), for the metrics row."""
        out, self.settled_new = sorted(set(self.settled_new) & self.settled_set), []
        return out

    def state(self) -> dict:
        return {"streak": [[i, r, n] for i, (r, n) in sorted(self.streak.items())], "skipped_draws": self.skipped_draws}

    def restore(self, state: dict) -> None:
        """A checkpoint's memory (judged with this run's k: a changed k re-judges every streak)."""
        self.streak = {int(i): (float(r), int(n)) for i, r, n in state.get("streak", [])}
        self.settled_set = {i for i, (_, n) in self.streak.items() if n >= self.k}
        self.skipped_draws = int(state.get("skipped_draws", 0))
        self.settled_new = []
