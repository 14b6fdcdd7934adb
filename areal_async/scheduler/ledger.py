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

import functools
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from itertools import repeat
from operator import attrgetter, countOf
from typing import Optional


class SampleState(StrEnum):
    """Where a sample is. A ``StrEnum``: each member *is* its string (``SampleState.TRAINED == "trained"``),
    so trajectories.jsonl and checkpoints hold the same plain strings as before the enum existed."""

    ISSUED = "issued"
    GENERATED = "generated"
    REWARDED = "rewarded"
    BATCHED = "batched"
    TRAINED = "trained"
    ABORTED = "aborted"


class GroupState(StrEnum):
    """Where a group is: running until all its samples are rewarded, then ready, batched, trained."""

    RUNNING = "running"
    READY = "ready"
    BATCHED = "batched"
    TRAINED = "trained"
    ABORTED = "aborted"


FINAL = (SampleState.TRAINED, SampleState.ABORTED)
GROUP_FINAL = (GroupState.TRAINED, GroupState.ABORTED)
_ISSUED, _GENERATED, _REWARDED = SampleState.ISSUED, SampleState.GENERATED, SampleState.REWARDED
_SCORABLE = (SampleState.ISSUED, SampleState.GENERATED)
_BATCHED, _TRAINED = SampleState.BATCHED, SampleState.TRAINED
_STATUS = attrgetter("status")  # a record's status, read in C over a group's records


@dataclass(slots=True)
class SampleRecord:
    sample_id: str
    group_id: str
    prompt_id: str
    problem_index: int
    status: SampleState = SampleState.ISSUED
    worker: str = ""
    version_min: int = -1
    version_max: int = -1
    n_output_tokens: int = 0
    finish_reason: str = ""
    score: Optional[float] = None
    reward_status: str = ""
    train_step: int = -1
    reason: str = ""
    turns: int = 1  # turns of a rollout workflow's episode (plain sampling: 1)

    def __post_init__(self):
        if type(self.status) is not SampleState:  # a plain string (a checkpoint's); members need no lookup
            self.status = _state(SampleState, self.status, f"sample {self.sample_id!r}")


@dataclass(slots=True)
class GroupRecord:
    group_id: str
    prompt_id: str
    problem_index: int
    sample_ids: list[str]
    worker: str
    issued_version: int
    status: GroupState = GroupState.RUNNING

    def __post_init__(self):
        if type(self.status) is not GroupState:
            self.status = _state(GroupState, self.status, f"group {self.group_id!r}")


def _state(kind: type[StrEnum], value: str, what: str) -> StrEnum:
    """``value`` as a member of ``kind`` (a checkpoint holds plain strings); ValueError naming it if unknown."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what}: status {value!r} is not one of {[m.value for m in kind]}") from None


@functools.cache
def _suffixes(n: int) -> tuple[str, ...]:
    """ ".0" .. ".<n-1>": a group's sample ids are its id and these."""
    return tuple(f".{k}" for k in range(n))


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
    members: dict[str, list[SampleRecord]] = field(default_factory=dict, repr=False)
    # group id -> its samples' records in order: a message about a whole group walks these, with no
    # per-sample lookup in ``samples`` (a large dict: each lookup is a few cache misses)
    ended: list[str] = field(default_factory=list, repr=False)  # groups made final since forget_final
    vmin: dict[str, int] = field(default_factory=dict, repr=False)  # ready (or later) group -> oldest version

    # ---- issuing -------------------------------------------------------------------------
    def issue_group(self, prompt_id: str, problem_index: int, n: int, worker: str, version: int) -> GroupRecord:
        gid = f"{self.id_prefix}g{self.n_groups_issued}"
        self.n_groups_issued += 1
        sids = [gid + k for k in _suffixes(n)]
        self.n_samples_issued += n
        g = self.groups[gid] = GroupRecord(gid, prompt_id, problem_index, sids, worker, version)
        recs = self.members[gid] = [SampleRecord(sid, gid, prompt_id, problem_index, _ISSUED, worker) for sid in sids]
        self.samples.update(zip(sids, recs))
        return g

    # ---- progress ------------------------------------------------------------------------
    def refuse(self, sample_id: str, group_id: str, event: Optional[SampleState] = None) -> Optional[str]:
        """Why a message about this sample must be ignored, or None if it is live (and, with
        ``event`` GENERATED or REWARDED, not already recorded as such)."""
        rec = self.samples.get(sample_id)
        if rec is None:
            return f"unknown sample {sample_id!r}"
        if rec.group_id != group_id:
            return f"sample {sample_id!r} belongs to group {rec.group_id!r}, not {group_id!r}"
        if rec.status in FINAL:
            return f"sample {sample_id!r} already {rec.status}"
        generated_twice = event == SampleState.GENERATED and rec.status != SampleState.ISSUED
        if generated_twice or (event == SampleState.REWARDED and rec.score is not None):
            return f"sample {sample_id!r} already {event}"
        return None

    def mark_generated(self, sample_id: str, version_min: int, version_max: int, n_tokens: int, finish: str) -> bool:
        """Record generation; True when the sample's group became ready."""
        rec = self.samples[sample_id]
        if rec.status != SampleState.ISSUED:
            raise LedgerError(f"sample {sample_id}: generated twice (status {rec.status})")
        rec.version_min, rec.version_max = version_min, version_max
        rec.n_output_tokens, rec.finish_reason = n_tokens, finish
        rec.status = SampleState.REWARDED if rec.score is not None else SampleState.GENERATED
        return self.check_ready(rec.group_id)

    def mark_rewarded(self, sample_id: str, score: float, status: str) -> bool:
        """Record the reward; True when the sample's group became ready."""
        rec = self.samples[sample_id]
        if rec.score is not None or rec.status not in (SampleState.ISSUED, SampleState.GENERATED):
            raise LedgerError(f"sample {sample_id}: rewarded twice (status {rec.status})")
        rec.score, rec.reward_status = float(score), status
        if rec.status == SampleState.GENERATED:
            rec.status = SampleState.REWARDED
        return self.check_ready(rec.group_id)

    def _records(self, gid: str, sids: list[str]) -> list[Optional[SampleRecord]]:
        """The records of ``sids`` as a message about group ``gid`` names them (None: unknown). A
        message naming the whole group in order (the common case) gets the group's list as is."""
        g = self.groups.get(gid)
        if g is not None and sids == g.sample_ids:
            return self.members[gid]
        return list(map(self.samples.get, sids))

    def record_generated(self, gid: str, sids, n_tokens, vmins, vmaxs, finishes, turns) -> tuple[list[str], bool]:
        """Record the samples of a ``TrajectoryReady`` of group ``gid`` (its parallel per-sample lists;
        ``turns`` empty: one each), each checked on its own as ``refuse`` says. Returns (why each
        refused one was ignored, whether any was recorded). One loop without a call per sample: the
        scheduler's hot path."""
        whys, took = [], False
        per_sample = zip(self._records(gid, sids), sids, n_tokens, vmins, vmaxs, finishes, turns or repeat(None))
        for rec, sid, n_tok, vmin, vmax, finish, turn in per_sample:
            if rec is None or rec.group_id != gid or rec.status != _ISSUED:
                whys.append(self.refuse(sid, gid, _GENERATED) or f"sample {sid!r}: status {rec.status}")
                continue
            if turn is not None:
                rec.turns = turn
            rec.version_min, rec.version_max, rec.n_output_tokens, rec.finish_reason = vmin, vmax, n_tok, finish
            rec.status = _GENERATED if rec.score is None else _REWARDED
            took = True
        return whys, took

    def record_rewarded(self, gid: str, sids, scores, statuses) -> tuple[list[str], bool]:
        """Record the scores of a ``RewardResult`` of group ``gid`` (its per-sample lists), per sample as
        ``refuse`` says; returns as ``record_generated``."""
        whys, took = [], False
        for rec, sid, score, status in zip(self._records(gid, sids), sids, scores, statuses):
            if rec is None or rec.group_id != gid or rec.score is not None or rec.status not in _SCORABLE:
                whys.append(self.refuse(sid, gid, _REWARDED) or f"sample {sid!r}: status {rec.status}")
                continue
            rec.score, rec.reward_status = float(score), status
            if rec.status == _GENERATED:
                rec.status = _REWARDED
            took = True
        return whys, took

    def check_ready(self, gid: str) -> bool:
        """Mark a running group READY if every sample is rewarded; True when it became so now."""
        g, recs = self.groups[gid], self.members[gid]
        if g.status == GroupState.RUNNING and countOf(map(_STATUS, recs), _REWARDED) == len(recs):
            g.status = GroupState.READY
            self.vmin[gid] = min(map(attrgetter("version_min"), recs))  # fixed from now on
            return True
        return False

    def all_generated(self, gid: str) -> bool:
        """Every sample of the group is past ISSUED (generated, or further)."""
        return _ISSUED not in map(_STATUS, self.members[gid])

    def mark_batched(self, gids: list[str], step: int) -> None:
        for gid in gids:
            self._advance_group(gid, GroupState.READY, GroupState.BATCHED)
            recs = self.members[gid]
            if countOf(map(_STATUS, recs), _REWARDED) != len(recs):
                bad = next(r for r in recs if r.status != _REWARDED)
                raise LedgerError(f"sample {bad.sample_id}: illegal transition {bad.status} -> {_BATCHED}")
            for rec in recs:
                rec.status, rec.train_step = _BATCHED, step

    def mark_trained(self, gids: list[str], skipped: frozenset = frozenset(), reason: str = "") -> list[SampleRecord]:
        """The batch's groups trained; a sample in ``skipped`` (its minibatch's optimizer step was
        not applied) ends aborted with ``reason`` instead: it was not trained. Returns every record."""
        out = []
        for gid in gids:
            self._advance_group(gid, GroupState.BATCHED, GroupState.TRAINED)
            recs = self.members[gid]
            if countOf(map(_STATUS, recs), _BATCHED) != len(recs):
                bad = next(r for r in recs if r.status != _BATCHED)
                raise LedgerError(f"sample {bad.sample_id}: illegal transition {bad.status} -> {_TRAINED}")
            self.ended.append(gid)
            for rec in recs:
                rec.status = _TRAINED
            out += recs
        n_skipped = 0
        for rec in out if skipped else ():
            if rec.sample_id in skipped:
                rec.status, rec.reason = SampleState.ABORTED, reason
                n_skipped += 1
        self.n_aborted += n_skipped
        self.n_trained += len(out) - n_skipped
        return out

    def abort_group(self, gid: str, reason: str) -> list[SampleRecord]:
        g = self.groups[gid]
        if g.status in GROUP_FINAL:
            raise LedgerError(f"group {gid}: cannot abort, already {g.status}")
        g.status = GroupState.ABORTED
        self.ended.append(gid)
        out = self.members[gid]
        for rec in out:
            rec.status, rec.reason = SampleState.ABORTED, reason
        self.n_aborted += len(out)
        return list(out)

    def _advance_group(self, gid: str, frm: GroupState, to: GroupState) -> None:
        g = self.groups[gid]
        if g.status != frm:
            raise LedgerError(f"group {gid}: illegal transition {g.status} -> {to}")
        g.status = to

    # ---- queries -------------------------------------------------------------------------
    def group_version_min(self, gid: str) -> int:
        """The oldest token version among the group's samples (kept from the moment it is ready)."""
        v = self.vmin.get(gid)
        return min(r.version_min for r in self.members[gid]) if v is None else v

    def open_groups(self) -> list[GroupRecord]:
        return [g for g in self.groups.values() if g.status not in GROUP_FINAL]

    def counts(self) -> dict[str, int]:
        in_flight = sum(1 for r in self.samples.values() if r.status not in FINAL)
        return {
            "issued": self.n_samples_issued,
            "trained": self.n_trained,
            "aborted": self.n_aborted,
            "in_flight": in_flight,
            "lost": self.n_samples_issued - self.n_trained - self.n_aborted - in_flight,
        }

    def forget_final(self) -> None:
        """Drop ended groups from memory (their lines are already in trajectories.jsonl): those made
        final since the last call (``ended``), not a walk over every group."""
        ended, self.ended = self.ended, []
        for gid in ended:
            g = self.groups.get(gid)
            if g is None or g.status not in GROUP_FINAL:
                continue
            del self.members[gid], self.groups[gid]
            self.vmin.pop(gid, None)
            for sid in g.sample_ids:
                del self.samples[sid]

    # ---- checkpoint ----------------------------------------------------------------------
    def to_state(self) -> dict:
        return {
            "id_prefix": self.id_prefix,
            "n_groups_issued": self.n_groups_issued,
            "n_samples_issued": self.n_samples_issued,
            "n_trained": self.n_trained,
            "n_aborted": self.n_aborted,
            "groups": [asdict(g) for g in self.groups.values()],
            "samples": [_sample_state(s) for s in self.samples.values()],
        }

    @classmethod
    def from_state(cls, state: dict) -> "Ledger":
        led = cls(id_prefix=str(state.get("id_prefix", "")))
        led.n_groups_issued, led.n_samples_issued = int(state["n_groups_issued"]), int(state["n_samples_issued"])
        led.n_trained, led.n_aborted = int(state["n_trained"]), int(state["n_aborted"])
        for g in state["groups"]:
            led.groups[g["group_id"]] = GroupRecord(**g)
        for s in state["samples"]:
            led.samples[s["sample_id"]] = SampleRecord(**s)
        led.members = {gid: [led.samples[s] for s in g.sample_ids] for gid, g in led.groups.items()}
        led.ended = [gid for gid, g in led.groups.items() if g.status in GROUP_FINAL]
        led.vmin = {gid: led.group_version_min(gid) for gid, g in led.groups.items() if g.status != GroupState.RUNNING}
        return led


def _sample_state(rec: SampleRecord) -> dict:
    """A sample's checkpoint entry; ``turns`` only for a multi-turn episode (plain runs keep the old format)."""
    d = asdict(rec)
    if d["turns"] == 1:
        del d["turns"]
    return d
