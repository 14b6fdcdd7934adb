"""Side formats: the msgpack frames that are not control messages, typed like them.

Each is a ``SideMessage`` (see ``protocols.messages``): fields and their types are checked on
encode and on ``decode(data, (Cls, ...))``, so a missing, unknown or mistyped field is a
``ProtocolError`` naming it, exactly as on the control plane. Their layout on the wire is the
one they had before they were typed (flat ``{"v", "t", <fields>}``; the reward pipe: the bare
field map), so no peer sees a change but the stricter checks.

- ``TensorHeader``: first frame of a tensor message (``protocols.tensors``, ``transport.frames``).
- ``TrajectoryMeta``: the meta of a trajectory tensor message (``protocols.trajectories``).
- ``ShmTensors``, ``ShmRetire``, ``GroupTensors``, ``IpcTensors``: the notes the shm, gloo/nccl
  and cuda_ipc channels push while the payload moves out of band (``transport.notify``).
- ``WeightFetch``: a rollout worker asks the zmq weight publisher for one bucket.
- ``StoreRequest``, ``StoreReply``: a gloo/NCCL group's rendezvous store, served by its rank 0 over
  the run's (CURVE-authenticated) sockets (``transport.store``).
- ``RewardInit``, ``RewardReady``, ``RewardTasks``, ``RewardReply``: the reward pool <-> child pipe
  (length-prefixed frames, ``areal_async.reward._wire``).
- ``ForkServerReady``, ``ForkRequest``, ``Forked``, ``ForkExited``: the supervisor <-> its fork server
  pipe (the same frames; ``areal_async.supervisor.forkserver``).

Only msgpack-level imports here (no torch): the reward child imports this module.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar, Optional

from protocols.messages import SideMessage, side_message

MAX_TENSORS = 1 << 16


def _negative(msg: SideMessage, *names: str) -> Optional[str]:
    """The check of byte offsets/sizes lists: every entry >= 0."""
    for name in names:
        bad = [x for x in getattr(msg, name) if x < 0]
        if bad:
            return f"{name} has a negative entry {bad[0]}: expected ints >= 0"
    return None


# ---- tensors ---------------------------------------------------------------------------------


@side_message
class TensorHeader(SideMessage):
    """What follows a tensor message's header: each spec ``{name, dtype, shape, nbytes}`` (checked
    against the payload by ``protocols.tensors.check_spec``)."""

    TYPE: ClassVar[str] = "tensors"
    MAX_BYTES: ClassVar[int] = 4 * 1024 * 1024
    key: str
    meta: dict
    specs: list[dict]

    def validate(self) -> Optional[str]:
        if len(self.specs) > MAX_TENSORS:
            return f"header lists {len(self.specs)} tensors (limit {MAX_TENSORS})"
        return None


@side_message
class TrajectoryMeta(SideMessage):
    """The ``meta`` of a trajectory tensor message (``protocols.trajectories``): group ``group_ids[j]``
    holds the next ``group_sizes[j]`` samples of ``sample_ids`` and a prompt of ``prompt_lengths[j]``
    tokens; sample ``sample_ids[i]`` has ``lengths[i]`` output tokens."""

    TYPE: ClassVar[str] = "trajectory_meta"
    group_ids: list[str]
    group_sizes: list[int]
    prompt_lengths: list[int]
    sample_ids: list[str]
    lengths: list[int]
    # [] or one list a sample: output offsets where a new sequence starts (an agent's segments, trained apart)
    segment_starts: list[list[int]] = field(default_factory=list)

    def validate(self) -> Optional[str]:
        return trajectory_counts_problem(self)


def trajectory_counts_problem(m) -> Optional[str]:
    """What is inconsistent in the five lists of a ``TrajectoryMeta`` (or of anything that has them,
    as ``TrajectoryBatch``), or None."""
    g, n = len(m.group_ids), len(m.sample_ids)
    if not g:
        return "no groups: expected at least one"
    if len(m.group_sizes) != g or len(m.prompt_lengths) != g:
        return (
            f"{g} group ids, {len(m.group_sizes)} group sizes, {len(m.prompt_lengths)} prompt lengths: "
            "expected one size and one prompt length a group"
        )
    if len(m.lengths) != n:
        return f"{n} sample ids but {len(m.lengths)} lengths: expected one length a sample"
    if sum(m.group_sizes) != n:
        return f"group sizes {m.group_sizes[:8]} sum to {sum(m.group_sizes)}, not to the {n} sample ids"
    return _negative(m, "group_sizes", "prompt_lengths", "lengths") or segments_problem(m)


def segments_problem(m) -> Optional[str]:
    """What is wrong with ``m.segment_starts`` (none, or increasing offsets inside each sample's output), or None."""
    segs = getattr(m, "segment_starts", None) or []
    if segs and len(segs) != len(m.sample_ids):
        return f"{len(segs)} segment_starts lists for {len(m.sample_ids)} samples: expected none or one a sample"
    for sid, starts, n in zip(m.sample_ids, segs, m.lengths):
        if any(not isinstance(x, int) or not 0 < x < n for x in starts) or list(starts) != sorted(set(starts)):
            return f"sample {sid!r}: segment_starts {list(starts)[:8]}: expected increasing offsets in (0, {n})"
    return None


_NOTE_BYTES = 8 * 1024 * 1024


@side_message
class ShmTensors(SideMessage):
    """shm sender -> receiver: a message's payload is in segment ``seg`` (``size`` bytes mapped)."""

    TYPE: ClassVar[str] = "shm_tensors"
    MAX_BYTES: ClassVar[int] = _NOTE_BYTES
    seg: str
    size: int
    pooled: bool
    offsets: list[int]
    sizes: list[int]
    header: bytes  # a TensorHeader frame

    def validate(self) -> Optional[str]:
        return _negative(self, "offsets", "sizes")


@side_message
class ShmRetire(SideMessage):
    """shm sender -> receiver: the sender closed; forget the mappings of these segments."""

    TYPE: ClassVar[str] = "shm_retire"
    MAX_BYTES: ClassVar[int] = _NOTE_BYTES
    segs: list[str]


@side_message
class GroupTensors(SideMessage):
    """gloo/nccl sender -> receiver: rank ``src`` sends buffers of ``sizes`` bytes right after this."""

    TYPE: ClassVar[str] = "group_tensors"
    MAX_BYTES: ClassVar[int] = _NOTE_BYTES
    src: int
    sizes: list[int]
    header: bytes

    def validate(self) -> Optional[str]:
        return _negative(self, "sizes")


@side_message
class IpcTensors(SideMessage):
    """cuda_ipc sender -> receiver: the CUDA IPC handle of the payload (None: nothing to map)."""

    TYPE: ClassVar[str] = "ipc_tensors"
    MAX_BYTES: ClassVar[int] = _NOTE_BYTES
    ipc: Optional[dict]
    offsets: list[int]
    sizes: list[int]
    header: bytes

    def validate(self) -> Optional[str]:
        return _negative(self, "offsets", "sizes")


# ---- weights ---------------------------------------------------------------------------------


@side_message
class WeightFetch(SideMessage):
    """rollout worker -> zmq weight publisher: send bucket ``bucket`` of weights ``version``."""

    TYPE: ClassVar[str] = "weight_fetch"
    MAX_BYTES: ClassVar[int] = 4096
    version: int
    bucket: int


# ---- rendezvous store ------------------------------------------------------------------------

STORE_OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "num_keys")
_STORE_BYTES = 16 << 20  # a store value is an address, a unique id or a counter: kilobytes at most


@side_message
class StoreRequest(SideMessage):
    """group member -> its store server: ``op`` on ``keys`` (``value``/``expected``/``n`` as ``op`` needs);
    ``get`` and ``wait`` are answered once every key exists, or with an error after ``timeout_ms``."""

    TYPE: ClassVar[str] = "store_request"
    MAX_BYTES: ClassVar[int] = _STORE_BYTES
    id: int
    op: str
    keys: list[str]
    value: bytes = b""
    expected: bytes = b""
    n: int = 0
    timeout_ms: int = 0

    def validate(self) -> Optional[str]:
        if self.op not in STORE_OPS:
            return f"op {self.op!r}: expected one of {STORE_OPS}"
        if self.op != "num_keys" and not self.keys:
            return f"op {self.op!r} names no key"
        return None


@side_message
class StoreReply(SideMessage):
    """store server -> member: the answer to request ``id`` (``error`` non-empty: refused or timed out)."""

    TYPE: ClassVar[str] = "store_reply"
    MAX_BYTES: ClassVar[int] = _STORE_BYTES
    id: int
    value: bytes = b""
    n: int = 0
    error: str = ""


# ---- reward pool <-> child (bare field maps: the pipe is private to one pool and its children) --

_PIPE_BYTES = 64 << 20  # a reply is a few bytes; anything this big means a corrupt stream


@side_message
class RewardInit(SideMessage):
    """pool -> child, once, first: load ``fn`` ("module:function") and cap memory (0: no cap)."""

    TYPE: ClassVar[str] = "reward_init"
    INLINE: ClassVar[bool] = False
    MAX_BYTES: ClassVar[int] = _PIPE_BYTES
    fn: str
    kwargs: dict
    memory_limit_mb: int


@side_message
class RewardReady(SideMessage):
    """child -> pool, once: the function loaded (with the child's pid), or why not."""

    TYPE: ClassVar[str] = "reward_ready"
    INLINE: ClassVar[bool] = False
    MAX_BYTES: ClassVar[int] = _PIPE_BYTES
    ready: bool
    pid: Optional[int] = None
    error: Optional[str] = None

    def validate(self) -> Optional[str]:
        if self.ready and self.pid is None:
            return "ready without a pid"
        if not self.ready and self.error is None:
            return "not ready without an error"
        return None


@side_message
class RewardTasks(SideMessage):
    """pool -> child, repeated: score ``completions[i]`` against ``solutions[i]`` (and its question
    ``prompts[i]``, when the pool was given questions: a judge reads them), in order, one ``RewardReply``
    each, written as soon as that check ends (the pool times every check on its own)."""

    TYPE: ClassVar[str] = "reward_tasks"
    INLINE: ClassVar[bool] = False
    MAX_BYTES: ClassVar[int] = _PIPE_BYTES
    completions: list[str]
    solutions: list[list[str]]
    prompts: Optional[list[str]] = None

    def validate(self) -> Optional[str]:
        if not self.completions:
            return "no completions: expected at least one task"
        if len(self.solutions) != len(self.completions):
            return f"{len(self.completions)} completions but {len(self.solutions)} solution lists: expected one each"
        if self.prompts is not None and len(self.prompts) != len(self.completions):
            return f"{len(self.completions)} completions but {len(self.prompts)} prompts: expected one each"
        return None


@side_message
class RewardReply(SideMessage):
    """child -> pool, one per task: the score, or the error the reward function raised."""

    TYPE: ClassVar[str] = "reward_reply"
    INLINE: ClassVar[bool] = False
    MAX_BYTES: ClassVar[int] = _PIPE_BYTES
    score: Optional[float] = None
    error: Optional[str] = None

    def validate(self) -> Optional[str]:
        if (self.score is None) == (self.error is None):
            return "expected exactly one of score and error"
        return None


# ---- supervisor <-> its fork server (supervisor/zygote.py): {"v", "t", <fields>}, one pipe each way ----

_FORK_BYTES = 1 << 20  # a command line and an environment


@side_message
class ForkServerReady(SideMessage):
    """fork server -> supervisor, once, first: the modules imported (``ready``), or why not (``error``)."""

    TYPE: ClassVar[str] = "fork_server_ready"
    MAX_BYTES: ClassVar[int] = _FORK_BYTES
    ready: bool
    pid: int
    error: Optional[str] = None

    def validate(self) -> Optional[str]:
        if not self.ready and self.error is None:
            return "not ready without an error"
        return None


@side_message
class ForkRequest(SideMessage):
    """supervisor -> fork server: start ``argv`` (``[python, "-m", MODULE, *ARGS]``) as worker ``name`` in its
    own session, stdout and stderr appended to ``log_path``, with exactly ``env``, in ``cwd``."""

    TYPE: ClassVar[str] = "fork_request"
    MAX_BYTES: ClassVar[int] = _FORK_BYTES
    name: str
    argv: list[str]
    env: dict
    cwd: str
    log_path: str
    # signal numbers the supervisor ignores as it asks: exec keeps SIG_IGN, so Popen's child would ignore them too
    ignored: list[int] = field(default_factory=list)

    def validate(self) -> Optional[str]:
        bad = [k for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))]
        if not all(isinstance(s, int) and 0 < s < 65 for s in self.ignored):
            return f"ignored signals {self.ignored!r}: expected signal numbers"
        return f"env entry {bad[0]!r} is not str -> str" if bad else None


@side_message
class Forked(SideMessage):
    """fork server -> supervisor, one per request, in order: the child's pid, or why none started."""

    TYPE: ClassVar[str] = "forked"
    MAX_BYTES: ClassVar[int] = _FORK_BYTES
    name: str
    pid: Optional[int] = None
    error: Optional[str] = None

    def validate(self) -> Optional[str]:
        if (self.pid is None) == (self.error is None):
            return "expected exactly one of pid and error"
        return None


@side_message
class ForkExited(SideMessage):
    """fork server -> supervisor: a child it started ended; ``code`` as ``subprocess`` gives it (>= 0 the
    exit status, -N killed by signal N)."""

    TYPE: ClassVar[str] = "fork_exited"
    MAX_BYTES: ClassVar[int] = _FORK_BYTES
    pid: int
    code: int
