"""The rollout-engine seam: one small abstract base and the data types that cross it.

A rollout worker drives an engine from one thread::

    engine.add_request(req)            # any number, between steps
    while engine.has_work():
        done = engine.step()           # every active sequence advances by one token
        ...                            # ship finished groups; maybe engine.update_weights(v, sd)

A finished group is what the trainer receives, the one trajectory type (``protocols.trajectories``):
a ``TrajectoryBatch`` of the group (``group_output``: the torch engine's packed rows, the remote
engine's JSON lists end to end; or ``group_rows`` of its ``sample_row`` rows),
with the engine's ``finish_reasons``; the rollout worker sends it as it is.

Covered here: the contract (types, call order, what versions and logprobs mean). Not covered:
any implementation (``torch_engine.TorchEngine`` is the CPU/GPU embedded one; an SGLang engine
sits beside it), networking, scheduling policy.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from protocols.trajectories import Trajectory, TrajectoryBatch, as_column

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
    sample_ids: tuple[str, ...] = ()  # the n samples' ids (none given: "<group_id>/<i>")

    @functools.cached_property
    def ids(self) -> list[str]:
        """The samples' ids, made once."""
        return list(self.sample_ids) if self.sample_ids else [f"{self.group_id}/{i}" for i in range(self.n)]

    @functools.cached_property
    def prompt(self) -> torch.Tensor:
        """``prompt_ids`` as the prompt column (int32), made once: a group's rows share it."""
        return as_column(self.prompt_ids, "prompt_ids")

    def validate(self) -> "GenRequest":
        """Raise ``ValueError`` naming the first bad field; return self."""
        checks = [
            (bool(self.prompt_ids), "prompt_ids", "a non-empty list of token ids"),
            (self.n >= 1, "n", "an integer >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1"),
            (self.greedy or self.temperature > 0, "temperature", "> 0 (or greedy=True)"),
            (0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (len(self.sample_ids) in (0, self.n), "sample_ids", f"none or n={self.n} ids"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"GenRequest {self.group_id!r}: {name}={getattr(self, name)!r}, expected {expected}")
        return self


def group_output(req: GenRequest, lengths, output_ids, logprobs, versions, reasons, **more) -> TrajectoryBatch:
    """A finished group as an engine gives it: ``req``'s first ``len(lengths)`` samples, their outputs end to
    end (``lengths[i]`` tokens of sample i), with their finish reasons; ``more``: other per-token columns by
    name. Tensors already of their column's dtype (int32 ids and versions, float32 logprobs) are kept as
    they are; lists are converted once."""
    ids = req.ids[: len(lengths)]
    batch = TrajectoryBatch.group(req.group_id, ids, req.prompt, lengths, output_ids, logprobs, versions, **more)
    batch.finish_reasons = list(reasons)
    return batch


def sample_row(req: GenRequest, index: int, output_ids, logprobs, versions, reason: str, **more) -> Trajectory:
    """Sample ``index`` of ``req``, finished (an engine that finishes samples one at a time: the torch
    engine's row set aside); ``more``: other per-token columns by name; ``group_rows`` joins a group's rows. Not
    checked: an aborted sample may have no token."""
    cols = {"output_ids": output_ids, "logprobs": logprobs, "versions": versions, **more}
    cols = {name: as_column(x, name) for name, x in cols.items()}  # (kept as they are when of its dtype)
    return Trajectory.row(
        sample_id=req.ids[index], group_id=req.group_id, prompt_ids=req.prompt, finish_reason=reason, **cols
    )


def group_rows(rows: list[Trajectory]) -> TrajectoryBatch:
    """A group's finished rows (``sample_row``) as its batch (one copy of each column)."""
    return TrajectoryBatch.of_samples(rows)


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
    def step(self) -> list[TrajectoryBatch]:
        """Advance every active sequence by one token; return the groups whose n samples all finished."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any queued or running group is unfinished."""

    @abstractmethod
    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights of ``version``; running samples resume under them (their new tokens carry it)."""

    @abstractmethod
    def abort_all(self) -> list[TrajectoryBatch]:
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
