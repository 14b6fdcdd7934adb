"""Any agent as a rollout workflow: ``rollout.agent: "module:fn"`` with ``async def fn(client, task)``.

For every sample the rollout worker runs one episode::

    base_url, session = server.open_episode(engine)        # .../episodes/<token>/v1 on this worker
    client = openai.AsyncOpenAI(base_url=base_url, api_key=<the run's key>)
    reward = await fn(client, {"prompt": ..., "solutions": [...], "prompt_id": ..., "prompt_ids": [...],
                               "prompt_text": ..., "score": <reward.fn, async>})
    episode = session.trace.to_episode(reward, rollout.agent_drift)   # from the recorded ids only

The agent talks to the worker's ``OpenAIServer`` (``openai_server.py``), which generates every request on
this episode's ``EngineHandle`` (new weights interrupt it; tokens carry their versions) and records each
turn's exact ids. The n episodes of a group become one trajectory group: they share the longest common
prefix of their first prompts as the group's prompt (``share_prompt``); the rest of each episode's first
prompt is context (loss mask 0). ``fn`` returns the reward (a task score in [0, 1]) or ``(reward, info)``;
``info`` (a dict) is logged with the episode's trace when ``rollout.dump_to_file`` is on.

The drift of each episode is counted per template in the server's ``DriftCounter``; under
``agent_drift: refuse`` an episode with drift raises ``DriftRefused`` (its group is aborted with the
reason and re-issued, like any failed episode).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Optional

from areal_async.base.records import JsonlRecord
from areal_async.rollout.openai_server import OpenAIServer
from areal_async.workflows.agent_trace import EpisodeTrace
from areal_async.workflows.base import EngineHandle, Episode, Prompt, RolloutWorkflow

log = logging.getLogger("areal_async.agent")
TRACE_DIR = "agent_traces"  # RUN_DIR/agent_traces/<worker id>.jsonl: one line per finished episode


class AgentWorkflow(RolloutWorkflow):
    """Runs ``fn(client, task)`` per episode against ``server`` (see the module docstring)."""

    own_prompt = True  # episodes start from the agent's own rendered prompts (``Episodes``: share_prompt)

    def __init__(
        self,
        fn: Callable,
        name: str,
        server: OpenAIServer,
        drift_mode: str,
        api_key: str,
        prompt_text: Callable[[list[int]], str],
        traces: Optional[JsonlRecord] = None,
    ):
        self.fn, self.name, self.server, self.mode = fn, name, server, drift_mode
        self.api_key, self.prompt_text, self.traces = api_key or "no-key", prompt_text, traces
        self.episodes = 0
        self.last_trace: Optional[EpisodeTrace] = None  # the latest episode's turns (tests, debugging)

    async def arun_episode(self, engine: EngineHandle, prompt: Prompt) -> Episode:
        import openai  # the 'agent' extra; the worker of a run without an agent never needs it

        await self.server.start()
        base_url, session = self.server.open_episode(engine)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=self.api_key, max_retries=0, timeout=None)
        task = {
            "prompt": self.prompt_text(prompt.prompt_ids),
            "solutions": list(prompt.solutions),
            "prompt_id": prompt.prompt_id,
            "prompt_ids": list(prompt.prompt_ids),
            # the prompt as the run's template renders it, special tokens as text (a completions agent's prompt)
            "prompt_text": engine.tokenizer.decode(prompt.prompt_ids, skip_special_tokens=False),
            "score": engine.reward,  # await task["score"](text, solutions): reward.fn in killable processes
        }
        try:
            reward, info = split_result(await self.fn(client, task), self.name)
        finally:
            self.server.close_episode(base_url)
            await client.close()
        trace = self.last_trace = session.trace
        self.server.drift.add(trace, self.server.template)
        self._dump(prompt, trace, reward, info, getattr(engine, "group_id", None))
        ep, starts = trace.to_episode(reward, self.mode)
        ep.segment_starts = starts
        self.episodes += 1
        return ep

    def stats(self) -> dict:
        """Heartbeat stats: the agent's turns and template drifts so far (per template in the log)."""
        d = self.server.drift
        return {"agent_turns": sum(d.turns.values()), "agent_drifts": sum(d.drifts.values())}

    def _dump(self, prompt: Prompt, trace: EpisodeTrace, reward: float, info, group_id) -> None:
        if self.traces is None:
            return
        self.traces.write(
            {
                "group_id": group_id,
                "prompt_id": prompt.prompt_id,
                "reward": reward,
                "info": _jsonable(info),
                "drifts": [d.describe() for d in trace.drifts],
                "turns": [
                    {
                        "kind": t.kind,
                        "prompt_ids": list(t.prompt_ids),
                        "output_ids": list(t.gen.output_ids),
                        "logprobs": [round(float(x), 6) for x in t.gen.logprobs],
                        "versions": list(t.gen.versions),
                        "finish_reason": t.gen.finish_reason,
                    }
                    for t in trace.turns
                ],
            }
        )


def split_result(out, name: str) -> tuple[float, Optional[dict]]:
    """(reward, info) of what an agent returned: a number in [0, 1], or (number, info dict)."""
    info = None
    if isinstance(out, tuple) and len(out) == 2:
        out, info = out
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out) or not 0 <= out <= 1:
        raise ValueError(f"agent {name} returned {out!r:.80}; expected a reward in [0, 1] or (reward, info)")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"agent {name} returned info {info!r:.80}; expected a dict")
    return float(out), info


def _jsonable(info):
    try:
        json.dumps(info)
        return info
    except (TypeError, ValueError):
        return repr(info)[:2000]


class PromptTexts:
    """prompt ids -> the dataset's prompt text, for ``task["prompt"]``: the run's problems tokenized as the
    scheduler tokenizes them (built on first use). A prompt not found (a dataset whose prompts change during
    the run, e.g. a curriculum) is its ids decoded without special tokens, logged once."""

    def __init__(self, problems: Callable[[], list], encode: Callable[[str], list[int]], tokenizer):
        self._problems, self._encode, self._tok = problems, encode, tokenizer
        self._table: Optional[dict] = None
        self._warned = False

    def __call__(self, prompt_ids: list[int]) -> str:
        if self._table is None:
            self._table = {tuple(self._encode(p.prompt)): p.prompt for p in self._problems()}
        text = self._table.get(tuple(prompt_ids))
        if text is None:
            if not self._warned:
                log.warning("agent task: a prompt not in the dataset's table; its ids decoded are the prompt text")
                self._warned = True
            text = self._tok.decode(prompt_ids, skip_special_tokens=True)
        return text


def trace_record(run_dir, worker_id: str) -> JsonlRecord:
    return JsonlRecord(Path(run_dir) / TRACE_DIR / f"{worker_id}.jsonl")
