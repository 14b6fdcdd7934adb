"""The scheduler's table of registered workers: one typed ``WorkerRecord`` each, how often each id
registered, and the per-worker views that ``status.json``, the ``StatusReport`` and the metrics rows read.

A record is made by a ``Register`` that passed the checks (``SchedulerService._register``) and removed
when the worker is lost; a restarted worker (same id, new process) gets a new record and its
registrations count goes up by one (restarts = registrations - 1, kept after the record is gone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, KeysView, Optional

from protocols import messages as M

from areal_async.base.control import worker_of

ROLES = ("rollout", "reward", "trainer")
SENDERS: dict[type, tuple[str, ...]] = {  # the roles that may send a message type (others: any registered)
    M.TrajectoryReady: ("rollout",),
    M.WeightsLoaded: ("rollout",),
    M.GroupAborted: ("rollout",),
    M.GroupsStopped: ("rollout",),
    M.RewardResult: ("reward", "rollout"),  # a rollout's: a workflow's own scores, of the groups it holds
    M.WeightsPublished: ("trainer",),
    M.TrainerReady: ("trainer",),
    M.TrainStepDone: ("trainer",),
    M.EvalDone: ("trainer",),
    M.CheckpointSaved: ("trainer",),
    M.HeldReply: ("trainer",),
}
# heartbeat stats copied into status.json for the overdue attribution (scheduler/overdue.py)
STATUS_STATS = ("engine_step_s", "episodes", "episode_oldest_s", "workflow", "scoring_oldest_s")


@dataclass
class WorkerRecord:
    """One registered worker as the scheduler knows it."""

    worker_id: str
    role: str  # rollout | reward | trainer
    ident: bytes  # the ROUTER identity that registered: every later message must come from it
    pid: int  # by its own account
    host: str  # likewise
    since: float  # monotonic time of the registration
    last_seen: float  # monotonic time of its last message
    stats: dict = field(default_factory=dict)  # its last heartbeat's stats
    samples: int = 0  # samples it delivered (generated, or scored)

    @property
    def busy_s(self) -> float:
        """Its cumulative busy seconds, as its last heartbeat said (0 before one)."""
        return float(self.stats.get("busy_s", 0.0))

    def status(self, now: float) -> dict:
        """Its entry in ``status.json``: role, silence, what it waits for, the stats the overdue check reads."""
        return {
            "role": self.role,
            "silent_s": round(now - self.last_seen, 1),
            "waiting_for": self.stats.get("waiting_for", ""),
            "stats": {k: v for k, v in self.stats.items() if k in STATUS_STATS},
        }

    def report(self, now: float, heartbeat_s: float, version: int, samples: int, restarts: int, groups: int) -> dict:
        """Its row of a ``StatusReport`` (``version``, ``samples``, ``groups``: the scheduler's view of them)."""
        silent = now - self.last_seen
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "pid": self.pid,
            "host": self.host,
            "state": "alive" if silent <= 2 * heartbeat_s else "silent",
            "version": version,
            "samples": samples,
            "samples_per_s": samples / max(1e-9, now - self.since),
            "groups": groups,
            "restarts": restarts,
            "silent_s": silent,
        }


class WorkerTable:
    """The registered workers by id (``in``, iteration over ids, ``[id]``) and every id's registrations."""

    def __init__(self) -> None:
        self.records: dict[str, WorkerRecord] = {}
        self.by_ident: dict[bytes, WorkerRecord] = {}  # the routing identity that registered -> its record
        self.registrations: dict[str, int] = {}  # worker_id -> times registered (a lost worker's entry stays)
        self.of_role: dict[str, dict[str, WorkerRecord]] = {r: {} for r in ROLES}  # in registration order

    def __contains__(self, wid: object) -> bool:
        return wid in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.records))  # a copy: callers may lose workers while they iterate

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, wid: str) -> WorkerRecord:
        return self.records[wid]

    def get(self, wid: str) -> Optional[WorkerRecord]:
        return self.records.get(wid)

    def add(self, worker_id: str, role: str, ident: bytes, pid: int, host: str, now: float) -> WorkerRecord:
        """A new record for a registration (any old one of that id must be removed first)."""
        if role not in ROLES:
            raise ValueError(f"register: role {role!r} is not {' | '.join(ROLES)}")
        if worker_id in self.records:
            raise RuntimeError(f"worker {worker_id!r} is registered already: remove its record first")
        rec = self.records[worker_id] = WorkerRecord(worker_id, role, ident, pid, host, since=now, last_seen=now)
        self.by_ident[ident] = rec
        self.of_role[role][worker_id] = rec
        self.registrations[worker_id] = self.registrations.get(worker_id, 0) + 1
        return rec

    def sender(self, ident: bytes, msg: M.Message, now: float) -> str:
        """The worker id of ``msg``'s sender, its record marked seen at ``now``; ``ValueError`` when it is
        not registered (a ``Ping`` needs no registration), not the connection that registered, or of a
        role that may not send ``msg`` (``SENDERS``; a ``Batch``: its items' type)."""
        w = self.by_ident.get(ident)  # a registered connection: one lookup, no parsing of the identity
        if w is None or w.ident != ident:
            wid = worker_of(ident)
            if wid in self.records:
                raise ValueError(f"{msg.TYPE} from {ident!r}, which is not the connection that registered as {wid!r}")
            if isinstance(msg, M.Ping):
                return wid
            raise ValueError(f"{msg.TYPE} from unregistered peer {wid!r}")
        w.last_seen = now
        cls = msg.item_type if type(msg) is M.Batch else type(msg)
        allowed = SENDERS.get(cls)
        if allowed and w.role not in allowed:
            raise ValueError(f"a {w.role} worker may not send {cls.TYPE!r} (only {' | '.join(allowed)})")
        return w.worker_id

    def pop(self, wid: str) -> WorkerRecord:
        rec = self.records.pop(wid)
        self.by_ident.pop(rec.ident, None)
        self.of_role[rec.role].pop(wid, None)
        return rec

    def restarts(self, wid: str) -> int:
        return self.registrations.get(wid, 1) - 1

    def role(self, role: str) -> list[str]:
        """Ids of the workers of ``role``, in registration order (a copy)."""
        return list(self.of_role[role])

    def ids(self, role: str) -> KeysView[str]:
        """Ids of the workers of ``role``, in registration order: a live view, no copy (a check per message)."""
        return self.of_role[role].keys()

    def silent(self, now: float, timeout_s: float) -> list[tuple[str, float]]:
        """(id, seconds since its last message) of every worker silent for more than ``timeout_s``."""
        return [(w, now - r.last_seen) for w, r in self.records.items() if now - r.last_seen > timeout_s]

    def busy_s_total(self, role: str) -> float:
        """The workers of ``role``: their cumulative busy seconds, from their last heartbeats."""
        return sum(r.busy_s for r in self.records.values() if r.role == role)

    def stat_total(self, role: str, key: str) -> float:
        """The workers of ``role``: the sum of one cumulative heartbeat stat (0 where a worker has none)."""
        return sum(float(r.stats.get(key, 0) or 0) for r in self.records.values() if r.role == role)

    def status(self, now: float) -> dict[str, dict]:
        """``status.json``'s ``workers``: each worker's ``WorkerRecord.status``."""
        return {w: r.status(now) for w, r in self.records.items()}
