"""Rollout workflows broken on purpose (and a good one), for ``check-plugin`` (tests/unit/app/test_check_plugin.py)
and the workflow liveness runs (a hanging one, flaky ones: tests/e2e/test_e2e_workflows.py)."""

import asyncio
import os
import random
import time

from areal_async.workflows.base import EpisodeBuilder, RolloutWorkflow
from areal_async.workflows.multi_turn_math import MultiTurnMath


class GoodWorkflow(RolloutWorkflow):
    """Two turns with a feedback line between them."""

    async def arun_episode(self, engine, prompt):
        b = EpisodeBuilder(prompt.prompt_ids)
        b.add_generation(await engine.generate(b.input_ids, prompt.sampling))
        b.add_env(engine.tokenizer.encode(" again: "))
        b.add_generation(await engine.generate(b.input_ids, prompt.sampling))
        return b.finish(await engine.reward("x", prompt.solutions))


class ReturnsTokens:
    async def arun_episode(self, engine, prompt):
        return (await engine.generate(prompt.prompt_ids, prompt.sampling)).output_ids


class SyncEpisode:
    def arun_episode(self, engine, prompt):
        return None


class MaskTooShort(RolloutWorkflow):
    async def arun_episode(self, engine, prompt):
        b = EpisodeBuilder(prompt.prompt_ids)
        b.add_generation(await engine.generate(b.input_ids, prompt.sampling))
        b.episode.loss_mask.pop()
        return b.finish(1.0)


class HangsInGenerate(RolloutWorkflow):
    async def arun_episode(self, engine, prompt):
        time.sleep(3600)  # blocks the event loop: only a kill ends it


class Hang(RolloutWorkflow):
    """An episode that never returns (awaits for ever, cancellable): rollout.episode_timeout_s ends it."""

    async def arun_episode(self, engine, prompt):
        await asyncio.Event().wait()


class FlakyMultiTurn(MultiTurnMath):
    """Multi-turn math that raises on about ``rate`` of its episodes (a tool or sandbox error), seeded."""

    rate = 0.1

    def __init__(self):
        self.rng = random.Random(os.getpid())

    async def arun_episode(self, engine, prompt):
        if self.rng.random() < self.rate:
            raise ConnectionError("sandbox unreachable (injected)")
        return await super().arun_episode(engine, prompt)


class AlwaysRaises(FlakyMultiTurn):
    rate = 1.0
