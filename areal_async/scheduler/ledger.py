"""The trajectory ledger: where every issued sample is, and how it ended.

Sample states (a reward may arrive before the rollout's TrajectoryReady: it is kept and the
sample moves straight to ``rewarded`` when generation is reported)::

    issued --> generated --> rewarded --> batched --> trained
       \\___________\\____________\\___________\\--> aborted (with a reason)

``trained`` and ``aborted`` are final. Every transition is checked; an impossible one is a
bug and raises. Messages about samples the ledger does not know, or that already ended
(a late message from a worker whose work was re-issued), are refused with a reason the
caller logs: they never change the books.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

FINAL = ("trained", "aborted")
_NEXT = {"issued": "generated", "generated": "rewarded", "rewarded": "batched", "batched": "trained"}


@dataclass
class SampleRecord:
    sample_id: str
    group_id: str
    prompt_id: str
    problem_index: int
    status: str = "issued"
    worker: str = ""
    version_min: int = -1
    version_max: int = -1
    n_output_tokens: int = 0
    finish_reason: str = ""
    score: Optional[float] = None
    reward_status: str = ""
    train_step: int = -1
    reason: str = ""


@dataclass
class GroupRecord:
    group_id: str
    prompt_id: str
    problem_index: int
    sample_ids: list[str]
    worker: str
    issued_version: int
    status: str = "running"  # running | ready | batched | trained | aborted


class LedgerError(RuntimeError):
    """An impossible transition: a bug in the caller, not bad input from the wire."""


@dataclass
class Ledger:
    samples: dict[str, SampleRecord] = field(default_factory=dict)
    groups: dict[str, GroupRecord] = field(default_factory=dict)
    n_groups_issued: int = 0
    n_samples_issued: int = 0  # cumulative counters survive forget_final()
    n_trained: int = 0
    n_aborted: int = 0
    id_prefix: str = ""  # "r1-" after the first resume: ids never repeat across a resumed run

    # ---- issuing -------------------------------------------------------------------------
    def issue_group(self, prompt_id: str, problem_index: int, n: int, worker: str, version: int) -> GroupRecord:
        gid = f"{self.id_prefix}g{self.n_groups_issued}"
        self.n_groups_issued += 1
        sids = [f"{gid}.{k}" for k in range(n)]
        self.n_samples_issued += n
        self.groups[gid] = GroupRecord(gid, prompt_id, problem_index, sids, worker, version)
        for sid in sids:
            self.samples[sid] = SampleRecord(sid, gid, prompt_id, problem_index, worker=worker)
        return self.groups[gid]

    # ---- progress ------------------------------------------------------------------------
    def refuse(self, sample_id: str, group_id: str, event: Optional[str] = None) -> Optional[str]:
        """Why a message about this sample must be ignored, or None if it is live (and, with
        ``event`` 'generated' or 'rewarded', not already recorded as such)."""
        rec = self.samples.get(sample_id)
        if rec is None:
            return f"unknown sample {sample_id!r}"
        if rec.group_id != group_id:
            return f"sample {sample_id!r} belongs to group {rec.group_id!r}, not {group_id!r}"
        if rec.status in FINAL:
            return f"sample {sample_id!r} already {rec.status}"
        if (event == "generated" and rec.status != "issued") or (event == "rewarded" and rec.score is not None):
            return f"sample {sample_id!r} already {event}"
        return None

    def mark_generated(self, sample_id: str, version_min: int, version_max: int, n_tokens: int, finish: str) -> bool:
        """Record generation; True when the sample's group became ready."""
        rec = self.samples[sample_id]
        if rec.status != "issued":
            raise LedgerError(f"sample {sample_id}: generated twice (status {rec.status})")
        rec.version_min, rec.version_max, rec.n_output_tokens, rec.finish_reason = version_min, version_max, n_tokens, finish
        rec.status = "rewarded" if rec.score is not None else "generated"
        return self._maybe_ready(rec.group_id)

    def mark_rewarded(self, sample_id: str, score: float, status: str) -> bool:
        """Record the reward; True when the sample's group became ready."""
        rec = self.samples[sample_id]
        if rec.score is not None or rec.status not in ("issued", "generated"):
            raise LedgerError(f"sample {sample_id}: rewarded twice (status {rec.status})")
        rec.score, rec.reward_status = float(score), status
        if rec.status == "generated":
            rec.status = "rewarded"
        return self._maybe_ready(rec.group_id)

    def _maybe_ready(self, gid: str) -> bool:
        g = self.groups[gid]
        if g.status == "running" and all(self.samples[s].status == "rewarded" for s in g.sample_ids):
            g.status = "ready"
            return True
        return False

    def mark_batched(self, gids: list[str], step: int) -> None:
        for gid in gids:
            self._advance_group(gid, "ready", "batched")
            for sid in self.groups[gid].sample_ids:
                self._advance(sid, "batched")
                self.samples[sid].train_step = step

    def mark_trained(self, gids: list[str]) -> list[SampleRecord]:
        out = []
        for gid in gids:
            self._advance_group(gid, "batched", "trained")
            for sid in self.groups[gid].sample_ids:
                self._advance(sid, "trained")
                self.n_trained += 1
                out.append(self.samples[sid])
        return out

    def abort_group(self, gid: str, reason: str) -> list[SampleRecord]:
        g = self.groups[gid]
        if g.status in ("trained", "aborted"):
            raise LedgerError(f"group {gid}: cannot abort, already {g.status}")
        g.status = "aborted"
        out = []
        for sid in g.sample_ids:
            rec = self.samples[sid]
            rec.status, rec.reason = "aborted", reason
            self.n_aborted += 1
            out.append(rec)
        return out

    def _advance(self, sid: str, to: str) -> None:
        rec = self.samples[sid]
        if _NEXT.get(rec.status) != to:
            raise LedgerError(f"sample {sid}: illegal transition {rec.status} -> {to}")
        rec.status = to

    def _advance_group(self, gid: str, frm: str, to: str) -> None:
        g = self.groups[gid]
        if g.status != frm:
            raise LedgerError(f"group {gid}: illegal transition {g.status} -> {to}")
        g.status = to

    # ---- queries -------------------------------------------------------------------------
    def group_version_min(self, gid: str) -> int:
        return min(self.samples[s].version_min for s in self.groups[gid].sample_ids)

    def open_groups(self) -> list[GroupRecord]:
        return [g for g in self.groups.values() if g.status not in ("trained", "aborted")]

    def counts(self) -> dict[str, int]:
        in_flight = sum(1 for r in self.samples.values() if r.status not in FINAL)
        return {"issued": self.n_samples_issued, "trained": self.n_trained, "aborted": self.n_aborted,
                "in_flight": in_flight,
                "lost": self.n_samples_issued - self.n_trained - self.n_aborted - in_flight}

    def forget_final(self) -> None:
        """Drop ended groups from memory (their lines are already in trajectories.jsonl)."""
        for gid in [g.group_id for g in self.groups.values() if g.status in ("trained", "aborted")]:
            for sid in self.groups.pop(gid).sample_ids:
                self.samples.pop(sid)

    # ---- checkpoint ----------------------------------------------------------------------
    def to_state(self) -> dict:
        return {"id_prefix": self.id_prefix, "n_groups_issued": self.n_groups_issued,
                "n_samples_issued": self.n_samples_issued,
                "n_trained": self.n_trained, "n_aborted": self.n_aborted,
                "groups": [asdict(g) for g in self.groups.values()],
                "samples": [asdict(s) for s in self.samples.values()]}

    @classmethod
    def from_state(cls, state: dict) -> "Ledger":
        led = cls(id_prefix=str(state.get("id_prefix", "")))
        led.n_groups_issued, led.n_samples_issued = int(state["n_groups_issued"]), int(state["n_samples_issued"])
        led.n_trained, led.n_aborted = int(state["n_trained"]), int(state["n_aborted"])
        for g in state["groups"]:
            led.groups[g["group_id"]] = GroupRecord(**g)
        for s in state["samples"]:
            led.samples[s["sample_id"]] = SampleRecord(**s)
        return led
