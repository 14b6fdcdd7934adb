"""The rollout-engine seam: one small abstract base and the data types that cross it.

A rollout worker drives an engine from one thread::

    engine.add_request(req)            # any number, between steps
    while engine.has_work():
        done = engine.step()           # every active sequence advances by one token
        ...                            # ship finished groups; maybe engine.update_weights(v, sd)

Covered here: the contract (types, call order, what versions and logprobs mean). Not covered:
any implementation (``torch_engine.TorchEngine`` is the CPU/GPU embedded one; an SGLang engine
sits beside it), networking, scheduling policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from protocols.trajectories import TrajectoryBatch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class GenRequest:
    """Generate ``n`` samples (one GRPO group) continuing ``prompt_ids``."""

    group_id: str
    prompt_ids: list[int]
    n: int  # samples of this prompt (a GRPO group)
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()  # eos always stops too

    def validate(self) -> "GenRequest":
        """Raise ``ValueError`` naming the first bad field; return self."""
        checks = [
            (bool(self.prompt_ids), "prompt_ids", "a non-empty list of token ids"),
            (self.n >= 1, "n", "an integer >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1"),
            (self.greedy or self.temperature > 0, "temperature", "> 0 (or greedy=True)"),
            (0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"GenRequest {self.group_id!r}: {name}={getattr(self, name)!r}, expected {expected}")
        return self


@dataclass
class SampleOutput:
    """One finished sample. ``logprobs``/``versions`` align with ``output_ids``.

    1D tensors (int64 ids, float32 logprobs, int64 versions), so a sample goes from the engine to
    the trainer's packed batch without a per-token Python list; lists given by an engine that
    produces them (e.g. from an HTTP reply) are converted here, once.
    """

    output_ids: torch.Tensor
    # behaviour logprob of each generated token: log_softmax(logits / temperature)[token], before
    # top-p truncation; greedy uses temperature 1.
    logprobs: torch.Tensor
    versions: torch.Tensor  # policy version of the weights that produced each token
    finish_reason: str  # "stop" | "length" | "abort"

    def __post_init__(self) -> None:
        self.output_ids = torch.as_tensor(self.output_ids, dtype=torch.long)
        self.logprobs = torch.as_tensor(self.logprobs, dtype=torch.float32)
        self.versions = torch.as_tensor(self.versions, dtype=torch.long)
        n = self.output_ids.numel()
        if self.output_ids.dim() != 1 or self.logprobs.shape != (n,) or self.versions.shape != (n,):
            raise ValueError(
                f"SampleOutput: output_ids {tuple(self.output_ids.shape)}, logprobs "
                f"{tuple(self.logprobs.shape)}, versions {tuple(self.versions.shape)}; expected "
                "three 1D tensors of one length"
            )

    @classmethod
    def of_tensors(
        cls, output_ids: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, finish_reason: str
    ) -> "SampleOutput":
        """Without ``__post_init__``'s conversions and checks (a measurable cost per sample in a
        decode loop): for an engine whose three tensors are already 1D int64 / float32 / int64
        of one length."""
        sample = cls.__new__(cls)
        sample.output_ids, sample.logprobs, sample.versions = output_ids, logprobs, versions
        sample.finish_reason = finish_reason
        return sample


@dataclass
class PackedSamples:
    """A group's samples laid end to end: sample i's ids, logprobs and versions are the i-th
    ``lengths`` slices of ``output_ids`` (int64), ``logprobs`` (float32) and ``versions`` (int64).
    The form an engine that decodes many rows at once produces without a tensor view per sample,
    and the one a trajectory message (``to_batch``, ``protocols.trajectories``) carries."""

    output_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    lengths: list[int]
    finish_reasons: list[str]

    @classmethod
    def of_samples(cls, samples: list[SampleOutput]) -> "PackedSamples":
        cat = lambda name: torch.cat([getattr(s, name) for s in samples])  # noqa: E731
        return cls(
            cat("output_ids"),
            cat("logprobs"),
            cat("versions"),
            [s.output_ids.numel() for s in samples],
            [s.finish_reason for s in samples],
        )

    def to_batch(self, group_id: str, sample_ids: list[str], prompt_ids) -> TrajectoryBatch:
        """This group as a trajectory batch (its wire dtypes: one conversion of each tensor)."""
        return TrajectoryBatch.group(
            group_id, sample_ids, prompt_ids, self.lengths, self.output_ids, self.logprobs, self.versions
        )

    def split(self) -> list[SampleOutput]:
        """One ``SampleOutput`` per sample (views of the packed tensors)."""
        parts = (x.split(self.lengths) for x in (self.output_ids, self.logprobs, self.versions))
        return [SampleOutput.of_tensors(*p, why) for *p, why in zip(*parts, self.finish_reasons)]


class GroupOutput:
    """A finished group's n samples, as ``samples`` (one ``SampleOutput`` each) or ``packed``
    (``PackedSamples``): an engine gives either form and the other is built from it on first use
    (split into views, or concatenated), so a consumer reads whichever it needs."""

    def __init__(
        self, group_id: str, samples: list[SampleOutput] | None = None, packed: PackedSamples | None = None
    ) -> None:
        if (samples is None) == (packed is None):
            raise ValueError(f"GroupOutput {group_id!r}: expected exactly one of samples and packed")
        self.group_id, self._samples, self._packed = group_id, samples, packed

    @property
    def samples(self) -> list[SampleOutput]:
        if self._samples is None:
            self._samples = self._packed.split()
        return self._samples

    @property
    def packed(self) -> PackedSamples:
        if self._packed is None:
            self._packed = PackedSamples.of_samples(self._samples)
        return self._packed

    @property
    def n_samples(self) -> int:
        return len(self._samples if self._samples is not None else self._packed.lengths)

    def __repr__(self) -> str:
        return f"GroupOutput({self.group_id!r}, {self.n_samples} samples)"


ON_WEIGHTS = ("recompute", "keep", "finish")  # rollout.on_weights


class RolloutEngine(ABC):
    """Token-level generation engine hosting one policy.

    ``version`` is the version of the loaded weights, -1 before the first load. Every generated
    token records the version that produced it; weights may change between two ``step`` calls,
    mid-generation, and an implementation must never mix a KV cache computed by one version with
    weights of another (invariant 4) unless ``on_weights`` is "keep" (the run opted in: the cache
    computed by the old weights is kept, the tokens after the update carry the new version).

    ``on_weights`` (``rollout.on_weights``): "recompute" (the running sequences continue under the new
    weights, their cache recomputed), "keep" (they continue on their old cache) or "finish" (the
    rollout worker's engine thread holds new work, ``hold_new``, steps until ``in_flight`` is False,
    then loads: they finish under the old weights).
    """

    version: int = -1
    on_weights: str = "recompute"

    @abstractmethod
    def add_request(self, req: GenRequest) -> None:
        """Queue a group; it starts at the next ``step`` without waiting for running ones."""

    @abstractmethod
    def step(self) -> list[GroupOutput]:
        """Advance every active sequence by one token; return the groups whose n samples all finished."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any queued or running group is unfinished."""

    @abstractmethod
    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights of ``version``; running samples resume under them (their new tokens carry it)."""

    @abstractmethod
    def abort_all(self) -> list[GroupOutput]:
        """Finish everything now: unfinished samples keep their tokens and get finish_reason "abort"."""

    def in_flight(self) -> bool:
        """Whether any started sequence is unfinished (``on_weights`` "finish" waits for False)."""
        return self.has_work()

    def hold_new(self, hold: bool) -> None:  # noqa: B027 (optional: engines without one start nothing new anyway)
        """While ``hold``, start no queued request (running ones go on)."""

    def abort_groups(self, group_ids: list[str]) -> dict[str, int]:
        """Stop these groups now and forget them; returns each one's tokens generated so far (wasted). The
        default stops nothing (an engine without it finishes them; the scheduler refuses their results)."""
        return {}
