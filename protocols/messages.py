"""The control plane's messages: one typed dataclass per message a worker, the scheduler or a client
sends over a ZeroMQ socket (the wire form, ``Batch`` and the checks: ``protocols.wire``, re-exported
here, so ``from protocols.messages import decode, Batch, TrajectoryReady`` is the one import a peer needs).

Grouped by who talks: registration and liveness; the groups' way (scheduler -> rollout -> reward ->
scheduler, one message per group, several of one type in a ``Batch``); the trainer's plans, steps,
weights and checkpoints; aborts, errors and status.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar, Optional

from protocols.wire import (  # noqa: F401  (re-exported: the wire form is part of this module's interface)
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REGISTRY,
    SIDE_REGISTRY,
    Batch,
    Message,
    ProtocolError,
    SideMessage,
    same_lengths,
    batched,
    build,
    decode,
    encode,
    message,
    side_message,
    unbatch,
)

# --------------------------------------------------------------------------------------------
# registration and liveness
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


# --------------------------------------------------------------------------------------------
# the groups' way: scheduler -> rollout worker -> reward workers -> scheduler
# --------------------------------------------------------------------------------------------


@message
class GenerateRequest(Message):
    """scheduler -> rollout worker: generate n samples of one prompt (one group). The groups admitted
    together go to a worker in one ``Batch``."""

    TYPE: ClassVar[str] = "generate_request"
    KEY: ClassVar[str] = "group_id"
    PARALLEL: ClassVar[tuple[str, ...]] = ("sample_ids",)
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
class TrajectoryReady(Message):
    """rollout worker -> scheduler: samples of one group generated (their tensors went to the trainer).

    One message per group, not per sample: per-sample messages cost the scheduler and the
    rollout worker CPU in proportion to n (16 in boba). Parallel lists, one entry per sample;
    a group may also be reported in parts (any subset of its samples)."""

    TYPE: ClassVar[str] = "trajectory_ready"
    KEY: ClassVar[str] = "group_id"
    PARALLEL: ClassVar[tuple[str, ...]] = (
        "sample_ids",
        "n_output_tokens",
        "version_min",
        "version_max",
        "finish_reasons",
    )
    OPTIONAL: ClassVar[tuple[str, ...]] = ("turns",)
    group_id: str
    worker_id: str
    n_prompt_tokens: int
    sample_ids: list[str]
    n_output_tokens: list[int]
    version_min: list[int]
    version_max: list[int]
    finish_reasons: list[str]
    turns: list[int] = field(default_factory=list)  # per sample, from a rollout workflow; empty: one turn each


@message
class RewardRequest(Message):
    """rollout worker -> reward workers (PUSH/PULL work queue): score the completions of one group."""

    TYPE: ClassVar[str] = "reward_request"
    KEY: ClassVar[str] = "group_id"
    PARALLEL: ClassVar[tuple[str, ...]] = ("sample_ids", "completions")
    group_id: str
    sample_ids: list[str]
    completions: list[str]
    solutions: list[str]
    prompt: str = ""  # the question, for a reward that reads it (reward.judge); "" when none is sent


@message
class RewardResult(Message):
    """reward worker -> scheduler: scores of one group's samples (parallel lists). Also rollout
    worker -> scheduler for its own groups when a rollout workflow scored the episodes itself."""

    TYPE: ClassVar[str] = "reward_result"
    KEY: ClassVar[str] = "group_id"
    PARALLEL: ClassVar[tuple[str, ...]] = ("sample_ids", "scores", "statuses", "details")
    group_id: str
    worker_id: str
    sample_ids: list[str]
    scores: list[float]
    statuses: list[str]  # per sample: ok | timeout | error
    details: list[str]


# --------------------------------------------------------------------------------------------
# the trainer: plans, steps, weights, checkpoints
# --------------------------------------------------------------------------------------------


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
    ``TrajectoryReady``, but "went" is a ZeroMQ send queue that a SIGKILL empties."""

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


# --------------------------------------------------------------------------------------------
# aborts, errors, status
# --------------------------------------------------------------------------------------------


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
        why = same_lengths(self, "group_ids", "n_output_tokens")
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
    "groups",
    "restarts",
    "silent_s",
)


@message
class StatusReport(Message):
    """scheduler -> the requester: the books' counts and one entry per registered worker.

    ``workers``: maps with exactly ``STATUS_WORKER_KEYS``: state is 'alive' or 'silent' (no message
    for more than two heartbeat periods); version is the weights a rollout worker loaded (the
    trainer: the version it published; reward workers: -1); samples / samples_per_s: samples it
    delivered (generated, scored, trained) since it registered; groups: the groups the scheduler has out on a
    rollout worker now (issued to it, not yet generated and scored; other roles 0); restarts: registrations - 1."""

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
