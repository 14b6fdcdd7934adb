"""Typed wire messages of the control plane, their msgpack encoding and validation.

Every message on a ZeroMQ socket is one of the dataclasses below, encoded as a msgpack map
``{"v": PROTOCOL_VERSION, "t": <type name>, "b": {<fields>}}``. Decoding checks, in order: the
frame size, that the bytes are msgpack, the envelope keys, the protocol version, that the type
is registered (and, when the receiver says what it expects, that it is one of those), that no
field is missing or unknown, every field's type, and the message's own consistency check
(``validate``: e.g. parallel per-sample lists of equal length). Anything else raises ``ProtocolError`` with
a message that names what was wrong; receivers log it and keep serving.

Side formats (``protocols.side``: the tensor header, the transport notes, the weight fetch, the
reward pool's pipe) are ``SideMessage`` classes: the same typed fields and the same checks, in the
flat layout those formats have always had on the wire. ``decode`` is the one place where msgpack
bytes become a message, for both kinds.

Never pickle: msgpack carries only plain data, so a peer cannot make us run code.
Bulk tensors do not travel in these messages (see ``protocols.tensors`` for tensor frames).
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass, field
from itertools import chain
from operator import countOf
from typing import Any, Callable, ClassVar, Optional, Union

PROTOCOL_VERSION = 2  # 2: one TrajectoryReady / RewardRequest / RewardResult per group
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # control messages are small; tensors use tensor frames


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _msgpack():
    """msgpack, imported at the first encode or decode: the message classes import without it, so code that
    only builds or validates them (the tensor frames' headers in GPU code) runs where msgpack is not installed
    (the bare GPU box of ``scripts/gpu_check.sh``)."""
    import msgpack

    return msgpack


REGISTRY: dict[str, type["Message"]] = {}  # control messages, looked up by the envelope's "t"
SIDE_REGISTRY: dict[str, type["SideMessage"]] = {}  # side formats, always decoded against an explicit type


def message(cls: type) -> type:
    """Class decorator: make a dataclass and register it under its TYPE name."""
    return _register(cls, REGISTRY)


def side_message(cls: type) -> type:
    """Class decorator for a ``SideMessage``: a dataclass registered under its TYPE name."""
    if not issubclass(cls, SideMessage):
        raise TypeError(f"{cls.__name__} must subclass SideMessage")
    return _register(cls, SIDE_REGISTRY)


def _register(cls: type, registry: dict) -> type:
    cls = dataclass(cls)
    name = cls.TYPE
    if name in REGISTRY or name in SIDE_REGISTRY:
        raise RuntimeError(f"message type {name!r} registered twice")
    registry[name] = cls
    return cls


class Message:
    TYPE: ClassVar[str] = ""

    def to_body(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> Optional[str]:
        """What is wrong with this message beyond field types (checked on encode and decode), or None."""
        return None


class SideMessage(Message):
    """A message of a side format, in that format's flat layout: ``{"v", "t", <fields>}`` (``INLINE``)
    or, for the reward pool's private pipe, the bare map of fields. A field whose default is None
    is left out while it is None (so ``{"score": 1.0}`` and ``{"error": "..."}`` are one type)."""

    INLINE: ClassVar[bool] = True
    MAX_BYTES: ClassVar[int] = MAX_MESSAGE_BYTES

    def to_body(self) -> dict:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not (f.default is None and getattr(self, f.name) is None)
        }


# --------------------------------------------------------------------------------------------
# the messages
# --------------------------------------------------------------------------------------------


@message
class Register(Message):
    """worker -> scheduler, first message on a DEALER: who I am."""

    TYPE: ClassVar[str] = "register"
    role: str  # rollout | reward | trainer
    worker_id: str
    pid: int
    host: str = ""
    info: dict = field(default_factory=dict)
    token: str = ""  # the launch token the supervisor gave this worker (base/runkeys.py)


@message
class RegisterAck(Message):
    """scheduler -> worker: registration accepted."""

    TYPE: ClassVar[str] = "register_ack"
    worker_id: str
    version: int  # the scheduler's current policy version


@message
class Heartbeat(Message):
    """worker -> scheduler, every cluster.heartbeat_s."""

    TYPE: ClassVar[str] = "heartbeat"
    worker_id: str
    ts: float
    stats: dict = field(default_factory=dict)


@message
class GenerateRequest(Message):
    """scheduler -> rollout worker: generate n samples of one prompt (one group)."""

    TYPE: ClassVar[str] = "generate_request"
    group_id: str
    prompt_id: str
    sample_ids: list[str]
    prompt_ids: list[int]
    solutions: list[str]
    min_version: int  # do not start before weights of at least this version are loaded
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)


@message
class GenerateRequests(Message):
    """scheduler -> rollout worker: several groups admitted together, one message (a
    ``GenerateRequest`` each: group ``group_ids[i]`` is prompt ``prompt_keys[i]`` (its
    ``prompt_id``) with samples ``sample_ids[i]``, prompt tokens ``prompt_tokens[i]`` and references
    ``solutions[i]``; ``min_version`` and the sampling parameters are the same for all)."""

    TYPE: ClassVar[str] = "generate_requests"
    group_ids: list[str]
    prompt_keys: list[str]
    sample_ids: list[list[str]]
    prompt_tokens: list[list[int]]
    solutions: list[list[str]]
    min_version: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    _SHARED: ClassVar[tuple[str, ...]] = (
        "min_version",
        "max_new_tokens",
        "temperature",
        "top_p",
        "greedy",
        "stop_token_ids",
    )

    def validate(self) -> Optional[str]:
        why = _same_lengths(self, "group_ids", "prompt_keys", "sample_ids", "prompt_tokens", "solutions")
        if why or 0 not in map(len, self.sample_ids):  # the common case decided in C
            return why
        for i, gid in enumerate(self.group_ids):
            if not self.sample_ids[i]:
                return f"group {gid!r} (#{i}) has no sample_ids"
        return None

    @classmethod
    def of(cls, requests: list[GenerateRequest]) -> "GenerateRequests":
        """``requests`` (at least one) in one message; ValueError if their shared fields differ."""
        first = requests[0]
        for r in requests[1:]:
            for name in cls._SHARED:
                if getattr(r, name) != getattr(first, name):
                    raise ValueError(
                        f"group {r.group_id!r} has {name}={getattr(r, name)!r}, group {first.group_id!r} "
                        f"{getattr(first, name)!r}: one GenerateRequests carries one value"
                    )
        return cls(
            **_columns(
                requests,
                group_ids="group_id",
                prompt_keys="prompt_id",
                sample_ids="sample_ids",
                prompt_tokens="prompt_ids",
                solutions="solutions",
            ),
            **{name: getattr(first, name) for name in cls._SHARED},
        )

    def requests(self) -> list[GenerateRequest]:
        """One ``GenerateRequest`` per group (already checked: no second validation)."""
        shared = {name: getattr(self, name) for name in self._SHARED}
        return [
            GenerateRequest(
                group_id=gid,
                prompt_id=self.prompt_keys[i],
                sample_ids=self.sample_ids[i],
                prompt_ids=self.prompt_tokens[i],
                solutions=self.solutions[i],
                **shared,
            )
            for i, gid in enumerate(self.group_ids)
        ]


@message
class TrajectoryReady(Message):
    """rollout worker -> scheduler: samples of one group generated (their tensors went to the trainer).

    One message per group, not per sample: per-sample messages cost the scheduler and the
    rollout worker CPU in proportion to n (16 in boba). Parallel lists, one entry per sample;
    a group may also be reported in parts (any subset of its samples)."""

    TYPE: ClassVar[str] = "trajectory_ready"
    group_id: str
    worker_id: str
    n_prompt_tokens: int
    sample_ids: list[str]
    n_output_tokens: list[int]
    version_min: list[int]
    version_max: list[int]
    finish_reasons: list[str]
    turns: list[int] = field(default_factory=list)  # per sample, from a rollout workflow; empty: one turn each

    def validate(self) -> Optional[str]:
        if self.turns and len(self.turns) != len(self.sample_ids):
            return f"turns has {len(self.turns)} entries for {len(self.sample_ids)} samples (expected none or one each)"
        return _same_lengths(self, "sample_ids", "n_output_tokens", "version_min", "version_max", "finish_reasons")


@message
class TrajectoriesReady(Message):
    """rollout worker -> scheduler: the groups one engine step finished, as one message (their
    tensors went to the trainer first). Per group, the fields of a ``TrajectoryReady`` (one entry
    each in these parallel per-group lists); the scheduler books each group as if it had come
    alone (``groups()``). ``TrajectoryReady`` stays valid for a single group."""

    TYPE: ClassVar[str] = "trajectories_ready"
    worker_id: str
    group_ids: list[str]
    n_prompt_tokens: list[int]
    sample_ids: list[list[str]]
    n_output_tokens: list[list[int]]
    version_min: list[list[int]]
    version_max: list[list[int]]
    finish_reasons: list[list[str]]

    @classmethod
    def of(cls, groups: list[TrajectoryReady]) -> "TrajectoriesReady":
        """``groups`` (one worker's, none with ``turns``) in one message; ValueError naming the group if not."""
        for g in groups:
            if g.worker_id != groups[0].worker_id or g.turns:
                what = f"turns {g.turns}" if g.turns else f"worker {g.worker_id!r}, not {groups[0].worker_id!r}"
                raise ValueError(f"group {g.group_id!r} has {what}: a TrajectoriesReady carries neither")
        same = ("n_prompt_tokens", "sample_ids", "n_output_tokens", "version_min", "version_max", "finish_reasons")
        return cls(worker_id=groups[0].worker_id, **_columns(groups, group_ids="group_id", **{f: f for f in same}))

    def groups(self) -> list[TrajectoryReady]:
        """One ``TrajectoryReady`` per group, in order."""
        return [
            TrajectoryReady(gid, self.worker_id, *fields)
            for gid, *fields in zip(
                self.group_ids,
                self.n_prompt_tokens,
                self.sample_ids,
                self.n_output_tokens,
                self.version_min,
                self.version_max,
                self.finish_reasons,
            )
        ]

    def validate(self) -> Optional[str]:
        why = _same_lengths(
            self,
            "group_ids",
            "n_prompt_tokens",
            "sample_ids",
            "n_output_tokens",
            "version_min",
            "version_max",
            "finish_reasons",
        )
        if why:
            return why
        if len(set(self.group_ids)) != len(self.group_ids):
            return f"group_ids repeat a group: {_short(self.group_ids)}"
        per_group = (self.sample_ids, self.n_output_tokens, self.version_min, self.version_max, self.finish_reasons)
        n = list(map(len, self.sample_ids))  # the common case in C: every group's lists as long as its ids, none empty
        if 0 not in n and all(list(map(len, lists)) == n for lists in per_group[1:]):
            return None
        for g in self.groups():  # the group at fault, named as its own TrajectoryReady would be
            why = g.validate()
            if why:
                return f"group {g.group_id!r}: {why}"
        return None


@message
class RewardRequest(Message):
    """rollout worker -> reward workers (PUSH/PULL work queue): score the completions of one group."""

    TYPE: ClassVar[str] = "reward_request"
    group_id: str
    sample_ids: list[str]
    completions: list[str]
    solutions: list[str]
    prompt: str = ""  # the question, for a reward that reads it (reward.judge); "" when none is sent

    def validate(self) -> Optional[str]:
        return _same_lengths(self, "sample_ids", "completions")


@message
class RewardRequests(Message):
    """rollout worker -> reward workers (PUSH/PULL work queue): several groups to score, one message
    (a ``RewardRequest`` each, as parallel lists per group: ``sample_ids[i]`` are group
    ``group_ids[i]``'s samples, ``completions[i]`` theirs, ``solutions[i]`` its references, ``prompts[i]``
    its question when the reward reads it; ``prompts`` empty when none is sent)."""

    TYPE: ClassVar[str] = "reward_requests"
    group_ids: list[str]
    sample_ids: list[list[str]]
    completions: list[list[str]]
    solutions: list[list[str]]
    prompts: list[str] = field(default_factory=list)

    def validate(self) -> Optional[str]:
        why = _same_lengths(self, "group_ids", "sample_ids", "completions", "solutions")
        if why:
            return why
        if self.prompts and len(self.prompts) != len(self.group_ids):
            return f"{len(self.prompts)} prompts for {len(self.group_ids)} groups: expected none or one a group"
        for i, gid in enumerate(self.group_ids):
            n, m = len(self.sample_ids[i]), len(self.completions[i])
            if n != m or n == 0:
                return f"group {gid!r} (#{i}): sample_ids={n}, completions={m}: expected equal and > 0"
        return None

    @classmethod
    def of(cls, requests: list["RewardRequest"]) -> "RewardRequests":
        prompts = [r.prompt for r in requests] if any(r.prompt for r in requests) else []
        return cls(
            **_columns(
                requests,
                group_ids="group_id",
                sample_ids="sample_ids",
                completions="completions",
                solutions="solutions",
            ),
            prompts=prompts,
        )

    def requests(self) -> list[RewardRequest]:
        """One ``RewardRequest`` per group (already checked: no second validation)."""
        prompts = self.prompts or [""] * len(self.group_ids)
        return [
            RewardRequest(gid, self.sample_ids[i], self.completions[i], self.solutions[i], prompts[i])
            for i, gid in enumerate(self.group_ids)
        ]


@message
class RewardResult(Message):
    """reward worker -> scheduler: scores of one group's samples (parallel lists). Also rollout
    worker -> scheduler for its own groups when a rollout workflow scored the episodes itself."""

    TYPE: ClassVar[str] = "reward_result"
    group_id: str
    worker_id: str
    sample_ids: list[str]
    scores: list[float]
    statuses: list[str]  # per sample: ok | timeout | error
    details: list[str]

    def validate(self) -> Optional[str]:
        return _same_lengths(self, "sample_ids", "scores", "statuses", "details")


@message
class RewardResults(Message):
    """reward worker -> scheduler: the scores of several groups scored together, one message (a
    ``RewardResult`` each, as parallel lists per group: ``sample_ids[i]`` are group
    ``group_ids[i]``'s samples, ``scores[i]``, ``statuses[i]``, ``details[i]`` theirs). The scheduler
    books each group exactly as its own ``RewardResult``."""

    TYPE: ClassVar[str] = "reward_results"
    worker_id: str
    group_ids: list[str]
    sample_ids: list[list[str]]
    scores: list[list[float]]
    statuses: list[list[str]]  # per sample: ok | timeout | error
    details: list[list[str]]

    def validate(self) -> Optional[str]:
        why = _same_lengths(self, "group_ids", "sample_ids", "scores", "statuses", "details")
        if why:
            return why
        n = list(map(len, self.sample_ids))  # the common case in C, as TrajectoriesReady.validate
        if 0 not in n and all(list(map(len, lists)) == n for lists in (self.scores, self.statuses, self.details)):
            return None
        for i, gid in enumerate(self.group_ids):
            n = {len(self.sample_ids[i]), len(self.scores[i]), len(self.statuses[i]), len(self.details[i])}
            if n != {len(self.sample_ids[i])} or not self.sample_ids[i]:
                return (
                    f"group {gid!r} (#{i}): sample_ids={len(self.sample_ids[i])}, scores={len(self.scores[i])}, "
                    f"statuses={len(self.statuses[i])}, details={len(self.details[i])}: expected equal and > 0"
                )
        return None

    def results(self) -> list[RewardResult]:
        """One ``RewardResult`` per group (already checked: no second validation)."""
        return [
            RewardResult(self.group_ids[i], self.worker_id, self.sample_ids[i], self.scores[i], s, self.details[i])
            for i, s in enumerate(self.statuses)
        ]


def _columns(items: list, **fields: str) -> dict[str, list]:
    """A batched message's per-group lists from its per-group messages: ``column=attribute`` pairs,
    ``column`` getting ``getattr(item, attribute)`` of every item in order."""
    return {column: [getattr(item, attr) for item in items] for column, attr in fields.items()}


def _same_lengths(msg: "Message", *names: str) -> Optional[str]:
    """The check of messages made of parallel per-sample lists: non-empty, equal lengths."""
    get = _GETTERS.get(names) or _GETTERS.setdefault(names, operator.attrgetter(*names))
    lengths = list(map(len, get(msg)))
    if lengths.count(lengths[0]) != len(lengths):
        return "parallel lists differ in length: " + ", ".join(f"{n}={k}" for n, k in zip(names, lengths))
    if lengths[0] == 0:
        return f"{names[0]} is empty"
    return None


_GETTERS: dict[tuple[str, ...], operator.attrgetter] = {}  # names -> one C call returning those fields


@message
class BatchPlan(Message):
    """scheduler -> trainer: train step `step` on these samples (grouped by group_id)."""

    TYPE: ClassVar[str] = "batch_plan"
    step: int
    sample_ids: list[str]
    group_ids: list[str]
    scores: list[float]
    aborted_ids: list[str] = field(default_factory=list)  # the trainer may drop their tensors
    # 0: the step's first plan. >0: it replaces the plan for `step` the trainer holds (some of that
    # plan's samples never reached the trainer, see HeldQuery); the trainer trains the latest one
    revision: int = 0


@message
class HeldQuery(Message):
    """scheduler -> trainer: a rollout worker died; which of these samples (its groups that were
    generated but not yet trained) reached the trainer? Their tensors went before the worker's
    ``TrajectoriesReady``, but "went" is a ZeroMQ send queue that a SIGKILL empties."""

    TYPE: ClassVar[str] = "held_query"
    query_id: int
    worker_id: str  # the worker that died (for the logs)
    sample_ids: list[str]


@message
class HeldReply(Message):
    """trainer -> scheduler: of a ``HeldQuery``'s samples, those whose tensors have not arrived after
    a grace for ones still in flight. The trainer refuses them from now on (a late copy is dropped);
    the scheduler aborts their groups, re-issues the prompts and revises any plan that named them."""

    TYPE: ClassVar[str] = "held_reply"
    query_id: int
    missing_ids: list[str]


@message
class TrainStepDone(Message):
    """trainer -> scheduler: step trained; weights of `version` = step + 1 are published."""

    TYPE: ClassVar[str] = "train_step_done"
    step: int
    version: int
    metrics: dict = field(default_factory=dict)
    checkpoint: str = ""  # path of a checkpoint saved after this step, if any
    # planned samples whose minibatch's optimizer step was skipped (grad norm not finite, or no
    # token kept): not trained; the scheduler books them aborted, not trained
    skipped_ids: list[str] = field(default_factory=list)


@message
class EvalDone(Message):
    """trainer -> scheduler: the periodic evaluator's result for the weights of `version` (a metrics row)."""

    TYPE: ClassVar[str] = "eval_done"
    version: int
    metrics: dict = field(default_factory=dict)  # eval_pass1, eval_pass1_ci_low / _high, eval_k, ...


@message
class WeightsPublished(Message):
    """trainer -> rollout workers (via the scheduler): new weights are on the weight channel."""

    TYPE: ClassVar[str] = "weights_published"
    version: int
    manifest: dict
    t_ready: float = 0.0  # wall time (time.time) of the optimizer step's end that made them; 0: none (initial)
    t_sent: float = 0.0  # wall time this message left the trainer (its payload is on the channel by then)


@message
class WeightsLoaded(Message):
    """rollout worker -> scheduler: this worker now generates with `version`."""

    TYPE: ClassVar[str] = "weights_loaded"
    worker_id: str
    version: int
    # wall times (time.time) of this update on the worker: 'manifest' (WeightsPublished in), 'received'
    # (off the channel, verified), 'load_start' (the engine thread took it between two steps), 'loaded'
    # (generating with it); and seconds 'load_s' / 'recompute_s' of the engine's own split, when it has one
    times: dict = field(default_factory=dict)


@message
class TrainerReady(Message):
    """trainer -> scheduler: initial weights (version `version`) are published; send plans."""

    TYPE: ClassVar[str] = "trainer_ready"
    version: int
    next_step: int


@message
class CheckpointRequest(Message):
    """scheduler -> trainer: save a checkpoint after `step` with this scheduler state."""

    TYPE: ClassVar[str] = "checkpoint_request"
    step: int
    state: dict


@message
class CheckpointSaved(Message):
    """trainer -> scheduler: the checkpoint asked for after `step` is complete at `path`."""

    TYPE: ClassVar[str] = "checkpoint_saved"
    step: int
    path: str


@message
class Shutdown(Message):
    """scheduler -> every worker: finish and exit. ``lost``: the scheduler declared this worker
    lost (no heartbeat) and has already re-issued its work: exit non-zero at once, so the
    supervisor restarts it (or fails the run) and nothing it still sends can count."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""
    lost: bool = False


@message
class GroupAborted(Message):
    """rollout worker -> scheduler: a group it holds cannot be generated (a workflow episode raised,
    timed out or returned a bad episode): abort it with ``reason`` and re-issue its prompt."""

    TYPE: ClassVar[str] = "group_aborted"
    group_id: str
    worker_id: str
    reason: str


@message
class AbortGroups(Message):
    """scheduler -> rollout worker: these groups were aborted (``reason``: e.g. past their deadline);
    stop their work (a workflow's episodes are cancelled)."""

    TYPE: ClassVar[str] = "abort_groups"
    group_ids: list[str]
    reason: str = ""


@message
class GroupsStopped(Message):
    """rollout worker -> scheduler: after ``AbortGroups`` its engine dropped these groups mid-generation;
    ``n_output_tokens[i]``: the tokens group i's samples had generated by then (generated, never trained:
    the step rows' ``wasted_tokens``). Groups the engine had already finished are not named (their late
    trajectory carries their tokens)."""

    TYPE: ClassVar[str] = "groups_stopped"
    worker_id: str
    group_ids: list[str]
    n_output_tokens: list[int]
    reason: str = ""

    def validate(self) -> Optional[str]:
        why = _same_lengths(self, "group_ids", "n_output_tokens")
        if why is None and any(n < 0 for n in self.n_output_tokens):
            return f"n_output_tokens {self.n_output_tokens}: expected counts >= 0"
        return why


@message
class Error(Message):
    """Any direction: the peer sent something we refused, or a worker hit a fatal error."""

    TYPE: ClassVar[str] = "error"
    code: str
    detail: str
    worker_id: str = ""


@message
class StatusRequest(Message):
    """anyone holding the run's keys -> scheduler (no registration needed): describe the fleet now."""

    TYPE: ClassVar[str] = "status_request"
    nonce: int


STATUS_WORKER_KEYS = (
    "worker_id",
    "role",
    "pid",
    "host",
    "state",
    "version",
    "samples",
    "samples_per_s",
    "restarts",
    "silent_s",
)


@message
class StatusReport(Message):
    """scheduler -> the requester: the books' counts and one entry per registered worker.

    ``workers``: maps with exactly ``STATUS_WORKER_KEYS``: state is 'alive' or 'silent' (no message
    for more than two heartbeat periods); version is the weights a rollout worker loaded (the
    trainer: the version it published; reward workers: -1); samples / samples_per_s: samples it
    delivered (generated, scored, trained) since it registered; restarts: registrations - 1."""

    TYPE: ClassVar[str] = "status_report"
    nonce: int
    version: int
    next_step: int
    total_steps: int
    finished: bool
    wall_s: float
    admitted: int  # groups issued since the start (re-issues included)
    running: int  # groups generating now
    ready: int  # groups generated and scored, waiting for a batch
    stale: int  # samples aborted as too stale for the next step, since the start
    samples_trained: int
    samples_aborted: int
    workers: list[dict] = field(default_factory=list)
    overdue: str = ""  # whose work is oldest and what it is stuck in (areal_async/scheduler/overdue.py)
    weight_update: dict = field(default_factory=dict)  # the last update every rollout loaded (see WeightUpdates)

    def validate(self) -> Optional[str]:
        for w in self.workers:
            if set(w) != set(STATUS_WORKER_KEYS):
                return f"worker entry keys {sorted(w)} != {sorted(STATUS_WORKER_KEYS)}"
        return None


@message
class Ping(Message):
    """Liveness probe; answered with Pong carrying the same nonce."""

    TYPE: ClassVar[str] = "ping"
    nonce: int


@message
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    nonce: int


# --------------------------------------------------------------------------------------------
# encoding and validation
# --------------------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    cls = type(msg)
    if REGISTRY.get(cls.TYPE, SIDE_REGISTRY.get(cls.TYPE)) is not cls:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a registered message type")
    for name, ok, tp, _ in _spec(cls):
        value = getattr(msg, name)
        if not ok(value):
            _type_error(value, tp, f"{msg.TYPE}.{name}")
    _check_consistent(msg)
    if not isinstance(msg, SideMessage):
        return _msgpack().packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, "b": msg.to_body()}, use_bin_type=True)
    body = msg.to_body()
    return _msgpack().packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, **body} if msg.INLINE else body, use_bin_type=True)


def decode(data: bytes | memoryview, expect: Optional[tuple[type, ...]] = None) -> Message:
    """Bytes -> message, or ProtocolError naming the problem. The one msgpack decode of the project.

    ``expect``: the message classes acceptable here. Control messages may leave it None (any
    registered type); side formats must name theirs (all side classes, never mixed with control)."""
    side = expect is not None and _is_side(expect)
    limit = max(c.MAX_BYTES for c in expect) if side else MAX_MESSAGE_BYTES
    if len(data) > limit:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {limit}-byte limit")
    raw = _unpack(data)
    cls, body = _side_body(raw, expect) if side else _envelope_body(raw, expect)
    return _build(cls, body)


def build(cls: type, body: Any) -> Message:
    """The message of type ``cls`` from a body already unpacked (a side format carried inside another
    frame, as a tensor header's ``meta``): the same field, type and consistency checks as ``decode``."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.TYPE}: body is {type(body).__name__} {_short(body)}, expected a map")
    return _build(cls, body)


def _is_side(expect: Optional[tuple[type, ...]]) -> bool:
    kinds = {issubclass(c, SideMessage) for c in expect or ()}
    if len(kinds) > 1:
        raise TypeError(f"expect mixes side formats and control messages: {[c.__name__ for c in expect]}")
    if True in kinds and len(expect) > 1 and not all(c.INLINE for c in expect):
        raise TypeError(f"a bare side format carries no type name: expect exactly one, got {expect}")
    return kinds == {True}


def _unpack(data: bytes | memoryview) -> Any:
    try:
        return _msgpack().unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__}: {e})") from None


def _envelope_body(env: Any, expect: Optional[tuple[type, ...]]) -> tuple[type, dict]:
    if not isinstance(env, dict) or len(env) != 3 or "v" not in env or "t" not in env or "b" not in env:
        got = sorted(env) if isinstance(env, dict) else type(env).__name__
        raise ProtocolError(f"frame is not a message envelope {{v, t, b}} (got {got})")
    _check_version(env["v"])
    if not isinstance(env["b"], dict):
        raise ProtocolError(f"message body of {env['t']!r} is {type(env['b']).__name__}, expected a map")
    name = env["t"]
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r} (known: {', '.join(sorted(REGISTRY))})")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message type {name!r} here (expected {', '.join(c.TYPE for c in expect)})")
    return cls, env["b"]


def _side_body(raw: Any, expect: tuple[type, ...]) -> tuple[type, dict]:
    names = " or ".join(c.TYPE for c in expect)
    if not isinstance(raw, dict):
        raise ProtocolError(f"{names} frame is {type(raw).__name__} {_short(raw)}, expected a map")
    if not expect[0].INLINE:
        return expect[0], raw
    _check_version(raw.get("v"))
    cls = next((c for c in expect if c.TYPE == raw.get("t")), None)
    if cls is None:
        raise ProtocolError(f"expected a {names} frame, got type {_short(raw.get('t'))}")
    return cls, {k: v for k, v in raw.items() if k not in ("v", "t")}


def _check_version(v: Any) -> None:
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r} is not supported (this side speaks {PROTOCOL_VERSION})")


def _build(cls: type, body: dict) -> Message:
    checks = _spec(cls)
    if len(body) > len(checks) or not _NAMES[cls].issuperset(body):
        raise ProtocolError(f"{cls.TYPE}: unknown field {sorted(set(body) - _NAMES[cls])[0]!r}")
    get = body.get
    for name, ok, tp, required in checks:
        value = get(name, _ABSENT)
        if value is _ABSENT:
            if required:
                raise ProtocolError(f"{cls.TYPE}: missing field {name!r}")
        elif not ok(value):
            _type_error(value, tp, f"{cls.TYPE}.{name}")
    msg = cls(**body)
    _check_consistent(msg)
    return msg


def _check_consistent(msg: Message) -> None:
    why = msg.validate()
    if why:
        raise ProtocolError(f"{msg.TYPE}: {why}")


_ABSENT = object()  # a field the body does not carry
_HINTS: dict[type, dict] = {}
_SPECS: dict[type, list] = {}
_NAMES: dict[type, frozenset] = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _spec(cls: type) -> list[tuple[str, Callable[[Any], bool], Any, bool]]:
    """Per field, in order: (name, type check, type, required). Built once per class: the checks
    are closures made from the type hints, so a frame pays no ``typing`` introspection."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints, fields = _hints(cls), dataclasses.fields(cls)
        spec = [
            (
                f.name,
                _checker(hints[f.name]),
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in fields
        ]
        _NAMES[cls] = frozenset(f.name for f in fields)
        _SPECS[cls] = spec
    return spec


def _type_error(value: Any, tp: Any, where: str) -> None:
    raise ProtocolError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:  # msgpack may carry an integral float as int
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checker(tp: Any) -> Callable[[Any], bool]:
    """A predicate: does a decoded value match the type hint ``tp`` (Optional/Union, None, int
    and float but never bool, list[...] item by item, dict, a class)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        alts = [_checker(a) for a in typing.get_args(tp)]
        return lambda v: any(ok(v) for ok in alts)
    if tp is type(None):
        return lambda v: v is None
    if tp is float:
        return _is_float
    if tp is int:
        return _is_int
    if origin is list:
        (item,) = typing.get_args(tp)
        ok_item = _checker(item)
        if item is str:  # the per-sample lists: one C-level pass each
            return lambda v: isinstance(v, list) and _all_str(v)
        if item in (int, float):  # exactly int (float) items counted in C; else item by item (bools never)
            return lambda v: isinstance(v, list) and (countOf(map(type, v), item) == len(v) or all(map(ok_item, v)))
        flat = _FLAT.get(typing.get_args(item)[0]) if typing.get_origin(item) is list else None
        if flat is not None:  # per group, per sample: proved in C over all items at once, else item by item
            return lambda v: _lists_of(v, flat) or (isinstance(v, list) and all(ok_item(x) for x in v))
        return lambda v: isinstance(v, list) and all(ok_item(x) for x in v)
    if tp is dict or origin is dict:
        return lambda v: isinstance(v, dict)
    return lambda v: isinstance(v, tp)


def _lists_of(v: Any, flat: Callable[[list], bool]) -> bool:
    """``v`` is exactly a list of exact lists whose items, all together, pass ``flat``: a sufficient
    condition checked in C (a False here is decided again item by item)."""
    return type(v) is list and countOf(map(type, v), list) == len(v) and flat(list(chain.from_iterable(v)))


def _all_numbers(v: list) -> bool:
    """Every item is exactly a float or an int (never a bool): what ``_is_float`` accepts, counted in C."""
    types = list(map(type, v))
    return countOf(types, float) + countOf(types, int) == len(types)


def _all_str(v: list) -> bool:
    """Every item is a str: ``str.join`` checks that in one C pass (a control frame is <= 16 MiB)."""
    try:
        "".join(v)
    except TypeError:
        return False
    return True


_FLAT: dict[type, Callable[[list], bool]] = {  # the item type of list[list[T]] -> all items are T, in C
    str: lambda v: _all_str(v),
    int: lambda v: countOf(map(type, v), int) == len(v),
    float: _all_numbers,
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
