"""The rollout-workflow seam: custom episodes (multi-turn, tools, retries) on any rollout engine.

``rollout.workflow: "package.module:Class"`` names a ``RolloutWorkflow``; the rollout worker
builds it once (no arguments) and, for every sample of a ``GenerateRequest``, awaits::

    episode = await workflow.arun_episode(engine, prompt)

``engine`` is an ``EngineHandle``: ``await engine.generate(input_ids, sampling)`` runs one
generation on the worker's engine (the embedded ``TorchEngine`` or a remote one: the handle sits
on the ``RolloutEngine`` seam, so interruption by new weights and per-token versions work as for
plain sampling) and returns its tokens, behaviour logprobs and per-token versions;
``engine.tokenizer`` encodes and decodes; ``await engine.reward(completion, solutions)`` scores a
text with ``reward.fn`` in the worker's killable reward processes.

The workflow builds its ``Episode`` with ``EpisodeBuilder``: model turns (``add_generation``:
trained, loss mask 1) and environment or tool tokens (``add_env``: not trained, loss mask 0,
logprob 0, version -1) appended after the prompt, then a reward (task score in [0, 1]) and the
number of turns. The n episodes of one request are one group: GRPO normalisation, the staleness
rule (judged by the oldest model token's version) and the exactly-once books treat them exactly
like n single-turn samples. The default workflow (``SingleTurn``) is today's sampling.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Protocol

FINISH = ("stop", "length", "abort")


@dataclass(frozen=True)
class Sampling:
    """How to sample one generation (the run's ``gconfig`` unless the workflow changes it)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Generation:
    """One generation: tokens with their behaviour logprobs and the policy version of each."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort


@dataclass
class Prompt:
    """What a workflow episode starts from."""

    prompt_id: str
    prompt_ids: list[int]
    solutions: list[str]
    sampling: Sampling


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class EngineHandle(ABC):
    """What a workflow may do with the worker's engine."""

    tokenizer: Tokenizer

    @abstractmethod
    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        """Continue ``input_ids``; the result's tokens follow them."""

    @abstractmethod
    async def reward(self, completion: str, solutions: list[str]) -> float:
        """``reward.fn`` on a text, in a killable process (0.0 on timeout or error)."""


@dataclass
class Episode:
    """One trajectory of a workflow: ``prompt_ids`` then ``output_ids`` (model and environment
    tokens interleaved), with one logprob, version and loss-mask entry per output token."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: trained (model token); 0: environment/tool token
    reward: float = 0.0
    turns: int = 0
    finish_reason: str = "stop"
    # output offsets where a new sequence starts (an agent's turns after template drift, trained as their own
    # segment: positions and attention restart there); [] = one sequence
    segment_starts: list[int] = field(default_factory=list)

    def problem(self) -> Optional[str]:
        """What is wrong with this episode, or None."""
        if not isinstance(self.prompt_ids, list) or not self.prompt_ids:
            return f"prompt_ids={_short(self.prompt_ids)}: expected a non-empty list of token ids"
        n = len(self.output_ids) if isinstance(self.output_ids, list) else -1
        for name in ("output_ids", "logprobs", "versions", "loss_mask"):
            value = getattr(self, name)
            if not isinstance(value, list) or len(value) != n:
                return f"{name} has {_len(value)} entries, expected one per output token ({n})"
        if not any(m == 1 for m in self.loss_mask):
            return "loss_mask has no 1: an episode must hold at least one model token to train on"
        if any(m not in (0, 1) for m in self.loss_mask):
            return f"loss_mask={_short(self.loss_mask)}: expected 0/1 entries"
        if any(m == 1 and v < 0 for m, v in zip(self.loss_mask, self.versions)):
            return "a trained token (loss_mask 1) has version < 0: model tokens carry the version that made them"
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            return f"reward={self.reward!r} ({type(self.reward).__name__}): expected a finite float in [0, 1]"
        if not 0.0 <= self.reward <= 1.0:
            return f"reward={self.reward!r}: expected a task score in [0, 1]"
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 1:
            return f"turns={self.turns!r}: expected an int >= 1"
        if self.finish_reason not in FINISH:
            return f"finish_reason={self.finish_reason!r}: expected one of {', '.join(FINISH)}"
        return self._segments_problem(n)

    def _segments_problem(self, n: int) -> Optional[str]:
        s = self.segment_starts
        if not isinstance(s, list) or any(not 0 < x < n for x in s) or s != sorted(set(s)):
            return f"segment_starts={_short(s)}: expected increasing output offsets in (0, {n})"
        if any(self.loss_mask[a] for a in s):
            return "a segment starts with a trained token; a segment starts with its own prompt (loss mask 0)"
        return None

    @property
    def model_versions(self) -> list[int]:
        """Versions of the trained tokens (staleness is judged by these)."""
        return [v for v, m in zip(self.versions, self.loss_mask) if m]


def _len(value) -> str:
    return str(len(value)) if isinstance(value, list) else f"no list ({type(value).__name__})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class EpisodeBuilder:
    """Appends turns to an episode: model generations (trained) and environment tokens (not)."""

    def __init__(self, prompt_ids: list[int]):
        self.episode = Episode(prompt_ids=list(prompt_ids))

    @property
    def input_ids(self) -> list[int]:
        """Everything so far: what the next generation continues."""
        return self.episode.prompt_ids + self.episode.output_ids

    def add_generation(self, gen: Generation) -> None:
        e = self.episode
        e.output_ids += list(gen.output_ids)
        e.logprobs += list(gen.logprobs)
        e.versions += list(gen.versions)
        e.loss_mask += [1] * len(gen.output_ids)
        e.turns += 1
        e.finish_reason = gen.finish_reason

    def add_env(self, token_ids: list[int]) -> None:
        e = self.episode
        e.output_ids += list(token_ids)
        e.logprobs += [0.0] * len(token_ids)
        e.versions += [-1] * len(token_ids)
        e.loss_mask += [0] * len(token_ids)

    def finish(self, reward: float) -> Episode:
        self.episode.reward = float(reward)
        return self.episode


class RolloutWorkflow(ABC):
    """A custom episode. Built once per rollout worker with no arguments (class attributes are
    its knobs: subclass to change them); ``arun_episode`` runs for every sample."""

    @abstractmethod
    async def arun_episode(self, engine: EngineHandle, prompt: Prompt) -> Episode:
        """Run turns on ``engine`` from ``prompt`` and return the episode (with its reward)."""


class SingleTurn(RolloutWorkflow):
    """One generation scored by ``reward.fn``: plain sampling written as a workflow."""

    async def arun_episode(self, engine: EngineHandle, prompt: Prompt) -> Episode:
        b = EpisodeBuilder(prompt.prompt_ids)
        gen = await engine.generate(b.input_ids, prompt.sampling)
        b.add_generation(gen)
        return b.finish(
            await engine.reward(engine.tokenizer.decode(gen.output_ids, skip_special_tokens=True), prompt.solutions)
        )
