"""Dynamic sampling (``rollout.dynamic_filter``): which scored groups are worth training.

A group is judged once, when its last sample is scored, by a function of its scores:

    nonzero_std            keep a group whose rewards are not all equal (DAPO's dynamic sampling:
                           a group of equal rewards has zero advantage under a group baseline)
    'module:function'      a plug-in, loaded as reward functions are (``base/plugins.load_callable``):
                           ``f(scores: list[float], **kwargs) -> bool``, True keeps the group;
                           kwargs: prompt_id, n_output_tokens (list, one per sample)

A dropped group is booked aborted by the scheduler (``SchedulerCore``) with the reason
``dynamic_filter: <name> ...``; it never counts as accepted, so admission refills its place under
the same staleness bound. A plug-in that raises or returns something other than a bool keeps
the group (nothing is lost to a broken filter) and is counted in ``errors`` with the last error.
Prompts whose groups keep being uniform are skipped before they are issued by the per-prompt memory,
``rollout.skip_solved_after`` (``prompt_memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from areal_async.base.plugins import FILTER_SIGNATURE, load_callable

BUILTIN = ("nonzero_std",)


def nonzero_std(scores: Sequence[float], **kwargs) -> bool:
    """Keep a group whose scores are not all equal (their standard deviation is not 0)."""
    return len(scores) > 0 and max(scores) > min(scores)


@dataclass
class GroupFilter:
    """A named keep/drop judgement of a group's scores, with its tallies."""

    name: str
    fn: Callable[..., object]
    dropped_groups: int = 0
    dropped_samples: int = 0
    errors: int = 0
    last_error: str = field(default="")

    def judge(self, scores: Sequence[float], **kwargs) -> Optional[str]:
        """None to keep the group, else the reason it is dropped (booked with each of its samples)."""
        try:
            keep = self.fn(list(scores), **kwargs)
        except Exception as e:  # a broken plug-in must not lose the group
            return self._error(f"raised {type(e).__name__}: {e}")
        if not isinstance(keep, bool):
            return self._error(f"returned {keep!r} ({type(keep).__name__}); expected a bool")
        if keep:
            return None
        self.dropped_groups += 1
        self.dropped_samples += len(scores)
        shown = ", ".join(f"{s:g}" for s in list(scores)[:8])
        return f"dynamic_filter: {self.name} dropped the group (rewards [{shown}])"

    def _error(self, what: str) -> None:
        self.errors += 1
        self.last_error = f"rollout.dynamic_filter {self.name!r} {what}; the group was kept"
        return None

    def counts(self) -> dict[str, int]:
        return {"groups": self.dropped_groups, "samples": self.dropped_samples, "errors": self.errors}


def build_group_filter(spec: str) -> Optional[GroupFilter]:
    """'' -> None (no filter); a built-in name; else a plug-in path (ValueError names what is wrong)."""
    if not spec:
        return None
    if spec == "nonzero_std":
        return GroupFilter(spec, nonzero_std)
    if ":" not in spec:
        raise ValueError(
            f"rollout.dynamic_filter={spec!r}: expected '' (off), one of {', '.join(BUILTIN)} or a plug-in "
            f"'module:function' with {FILTER_SIGNATURE}"
        )
    return GroupFilter(spec, load_callable(spec))
