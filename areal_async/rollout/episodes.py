"""Workflow episodes in a rollout worker: the engine handle a workflow drives, and one group's run.

``WorkerEngine.generate`` turns one call into a one-sample request on the worker's
``EngineThread`` (the same engine, batching and weight switches as plain sampling; so a
generation interrupted by new weights continues under them and its tokens carry both
versions) and awaits its row (``protocols.trajectories.Trajectory``). ``Episodes`` owns the worker's
episodes: it runs a ``GenerateRequest``'s n episodes as tasks it counts, bounds and cancels, and returns them in
sample order, each checked (``episode_problem``). ``ErrorWindow`` counts the failed ones.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import traceback
from collections import deque
from typing import Awaitable, Callable, Optional

from protocols.messages import GenerateRequest

from areal_async.rollout.engines.engine import GenRequest
from areal_async.workflows.agent_trace import share_prompt
from areal_async.workflows.base import EngineHandle, Episode, Generation, Prompt, RolloutWorkflow, Sampling

ScoreFn = Callable[[str, list], Awaitable[float]]


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


class EpisodeFailed(Exception):
    """One episode of a group raised, timed out or returned a bad episode: the group is aborted with
    ``reason`` (which names the workflow and the sample); ``trace``: the traceback, for the log."""

    def __init__(self, reason: str, trace: str = ""):
        super().__init__(reason)
        self.reason, self.trace = reason, trace


def episode_problem(ep, req: GenerateRequest, own_prompt: bool = False) -> Optional[str]:
    """What is wrong with a workflow's return value for one sample of ``req``, or None. ``own_prompt``: the
    workflow's episodes start from prompts of their own (an agent's chat template), not the request's."""
    if not isinstance(ep, Episode):
        return f"returned {type(ep).__name__}; expected an Episode"
    if why := ep.problem():
        return why
    if not own_prompt and ep.prompt_ids != list(req.prompt_ids):
        return "the episode's prompt_ids differ from the request's (an episode continues its prompt)"
    return None


class Episodes:
    """The workflow episodes of one rollout worker, each an ``asyncio`` task owned and counted here.

    ``start`` runs a ``GenerateRequest``'s n episodes as one group task (kept by group id, so
    ``cancel`` stops a group the scheduler aborted); each episode is bounded by ``timeout_s`` (0:
    none). The first episode that fails ends its group with ``EpisodeFailed`` and cancels its
    siblings; every episode's outcome goes to ``errors``. ``stats`` (heartbeat): episodes running,
    the oldest one's age, the workflow's name; ``close`` cancels everything and says how many tasks
    outlived the cancellation (leaked)."""

    def __init__(
        self,
        workflow: RolloutWorkflow,
        name: str,
        timeout_s: float,
        errors: Optional["ErrorWindow"] = None,
        clock=time.monotonic,
    ):
        self.workflow, self.name, self.timeout_s, self.clock = workflow, name, timeout_s, clock
        self.errors = errors or ErrorWindow(name, -1, 1)  # every episode's outcome, in start order
        self.started: dict[asyncio.Task, float] = {}  # live episode task -> when it started
        self.groups: dict[str, asyncio.Task] = {}  # group id -> its group task
        self.own_prompt = bool(getattr(workflow, "own_prompt", False))  # an agent: episodes start from their own

    def start(self, group_id: str, coro) -> asyncio.Task:
        """Run ``coro`` (which calls ``run_group``) as the task of group ``group_id``."""
        task = asyncio.create_task(coro, name=f"workflow group {group_id}")
        self.groups[group_id] = task
        task.add_done_callback(lambda t: self.groups.pop(group_id, None) if self.groups.get(group_id) is t else None)
        return task

    def cancel(self, group_ids: list[str]) -> int:
        """Cancel these groups' tasks (and with them their episodes); returns how many were running."""
        tasks = [self.groups[g] for g in group_ids if g in self.groups]
        for t in tasks:
            t.cancel()
        return len(tasks)

    def stats(self) -> dict:
        oldest = min(self.started.values(), default=None)
        extra = self.workflow.stats() if hasattr(self.workflow, "stats") else {}  # an agent's drift counts
        return {
            "workflow": self.name,
            "episodes": len(self.started),
            "episode_oldest_s": 0.0 if oldest is None else round(self.clock() - oldest, 1),
        } | extra

    async def run_group(self, engine: WorkerEngine, req: GenerateRequest) -> list[Episode]:
        """The group's episodes in sample order; ``EpisodeFailed`` for the first that failed."""
        prompt = prompt_of(req)
        tasks = [self._spawn(self._episode(engine, prompt, req, sid), sid) for sid in req.sample_ids]
        try:
            episodes = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one failed (or the group was cancelled): its siblings stop too
                t.cancel()
        if not self.own_prompt:
            return episodes
        try:  # an agent's episodes: one prompt for the group, their common prefix
            return share_prompt(episodes)
        except ValueError as e:
            raise EpisodeFailed(f"workflow {self.name}, group {req.group_id}: {e}") from None

    def _spawn(self, coro, sid: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"episode {sid}")
        self.started[task] = self.clock()
        seq = self.errors.start()
        task.add_done_callback(lambda t: self._ended(t, seq))
        return task

    def _ended(self, task: asyncio.Task, seq: int) -> None:
        self.started.pop(task, None)
        if task.cancelled():
            return self.errors.end(seq, None)
        exc = task.exception()  # retrieved here: the group reports a failure once
        self.errors.end(seq, exc is not None, getattr(exc, "reason", repr(exc)))

    async def _episode(self, engine: WorkerEngine, prompt: Prompt, req: GenerateRequest, sid: str) -> Episode:
        where = f"workflow {self.name}, sample {sid}"
        try:
            ep = await asyncio.wait_for(self.workflow.arun_episode(engine, prompt), self.timeout_s or None)
        except asyncio.TimeoutError:
            raise EpisodeFailed(
                f"{where}: episode_timeout: no episode within {self.timeout_s:g}s (rollout.episode_timeout_s)"
            ) from None
        except Exception as e:  # the workflow's own error: this group is aborted, the worker goes on
            raise EpisodeFailed(f"{where}: {type(e).__name__}: {e}", traceback.format_exc()) from None
        if why := episode_problem(ep, req, self.own_prompt):
            raise EpisodeFailed(f"{where}: {why}")
        return ep

    async def close(self, timeout_s: float = 2.0) -> int:
        """Cancel every group and episode; wait up to ``timeout_s`` for them to end. Returns the number
        of tasks still live then (an episode that ignores cancellation: leaked)."""
        live = [*self.groups.values(), *self.started]
        for t in live:
            t.cancel()
        if live:
            await asyncio.wait(live, timeout=timeout_s)
        return sum(1 for t in live if not t.done())


class ErrorWindow:
    """Failed episodes among the last ``window`` episode outcomes, in the order the episodes started;
    ``verdict`` says when there were more than ``max_errors`` (-1: never), naming the workflow and its
    last error.

    Start order, not end order: an episode that fails at once ends long before a good one of the same
    moment finishes generating, so judged as they end, a 10 % failure rate would look like 100 % at the
    start of a run. An outcome counts once every episode started before it has one; a cancelled
    episode (a sibling of a failed one, or of a group the scheduler aborted) has none and counts not."""

    def __init__(self, name: str, max_errors: int, window: int):
        self.name, self.max_errors, self.window = name, max_errors, window
        self.pending: dict[int, Optional[bool]] = {}  # started episode -> failed?, None while running
        self.outcomes: deque[bool] = deque(maxlen=window)  # True: failed
        self.n_started, self.last_error = 0, ""

    def start(self) -> int:
        self.n_started += 1
        self.pending[self.n_started] = None
        return self.n_started

    def end(self, seq: int, failed: Optional[bool], reason: str = "") -> None:
        """Episode ``seq`` ended: failed (True, with ``reason``), succeeded (False), cancelled (None)."""
        if failed is None:
            self.pending.pop(seq, None)
        else:
            self.pending[seq] = failed
        if failed:
            self.last_error = reason
        while self.pending:  # the prefix of started episodes that all have an outcome now counts
            first = next(iter(self.pending))
            if self.pending[first] is None:
                break
            self.outcomes.append(self.pending.pop(first))

    def verdict(self) -> Optional[str]:
        n = sum(self.outcomes)
        if self.max_errors < 0 or n <= self.max_errors:
            return None
        return (
            f"workflow {self.name}: {n} of its last {len(self.outcomes)} episodes failed "
            f"(rollout.max_workflow_errors={self.max_errors} in rollout.workflow_error_window={self.window}); "
            f"last error: {self.last_error}"
        )
