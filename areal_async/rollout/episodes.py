"""Workflow episodes in a rollout worker: the engine handle a workflow drives, and one group's run.

``WorkerEngine.generate`` turns one call into a one-sample request on the worker's
``EngineThread`` (the same engine, batching and weight switches as plain sampling; so a
generation interrupted by new weights continues under them and its tokens carry both
versions) and awaits its ``SampleOutput``. ``run_group`` runs a ``GenerateRequest``'s n
episodes concurrently and returns them in sample order, each checked (``Episode.problem``).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Awaitable, Callable

from protocols.messages import GenerateRequest

from areal_async.rollout.engine import GenRequest
from areal_async.workflows.base import EngineHandle, Episode, Generation, Prompt, RolloutWorkflow, Sampling

ScoreFn = Callable[[str, list], Awaitable[float]]


class EpisodeError(RuntimeError):
    """A workflow returned something that is not a well-formed episode."""


class SubRequest:
    """One generation of a workflow, queued on the engine thread like a group of one."""

    def __init__(self, group_id: str, min_version: int, gen: GenRequest, future: asyncio.Future):
        self.group_id, self.min_version, self.gen, self.future = group_id, min_version, gen, future


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


class WorkerEngine(EngineHandle):
    def __init__(
        self, submit: Callable[[SubRequest], None], tokenizer, score: ScoreFn, group_id: str, min_version: int = 0
    ):
        self._submit, self.tokenizer, self._score, self.min_version = submit, tokenizer, score, min_version
        self.group_id = group_id
        self._ids = itertools.count()

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        gid = f"{self.group_id}/gen-{next(self._ids)}"  # unique on the engine: one group of one sample
        gen = GenRequest(
            gid,
            list(input_ids),
            n=1,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            greedy=sampling.greedy,
            stop_token_ids=tuple(sampling.stop_token_ids),
        ).validate()
        fut = asyncio.get_running_loop().create_future()
        self._submit(SubRequest(gid, self.min_version, gen, fut))
        s = await fut
        return Generation(_as_list(s.output_ids), _as_list(s.logprobs), _as_list(s.versions), s.finish_reason)

    async def reward(self, completion: str, solutions: list[str]) -> float:
        return float(await self._score(completion, list(solutions)))


def prompt_of(req: GenerateRequest) -> Prompt:
    return Prompt(
        req.prompt_id,
        list(req.prompt_ids),
        list(req.solutions),
        Sampling(req.max_new_tokens, req.temperature, req.top_p, req.greedy, tuple(req.stop_token_ids)),
    )


async def run_group(workflow: RolloutWorkflow, engine: WorkerEngine, req: GenerateRequest) -> list[Episode]:
    """The group's episodes, one per sample id; ``EpisodeError`` names the first bad one."""
    prompt = prompt_of(req)
    episodes = await asyncio.gather(*(workflow.arun_episode(engine, prompt) for _ in req.sample_ids))
    for sid, ep in zip(req.sample_ids, episodes):
        if not isinstance(ep, Episode):
            raise EpisodeError(
                f"workflow {type(workflow).__name__} returned {type(ep).__name__} for sample {sid}; expected an Episode"
            )
        why = ep.problem()
        if why:
            raise EpisodeError(f"workflow {type(workflow).__name__}, sample {sid}: {why}")
        if ep.prompt_ids != list(req.prompt_ids):
            raise EpisodeError(
                f"workflow {type(workflow).__name__}, sample {sid}: the episode's prompt_ids differ "
                "from the request's (an episode continues its prompt)"
            )
    return list(episodes)
