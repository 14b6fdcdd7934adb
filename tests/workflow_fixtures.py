"""Rollout workflows broken on purpose (and a good one), for ``check-plugin`` (tests/test_check_plugin.py)."""

import time

from areal_async.workflows.base import EpisodeBuilder, RolloutWorkflow


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
