"""Multi-turn math: a wrong answer gets "try again" feedback and another turn; the reward is discounted per turn.

As AReaL's multi-turn math example: turn k (0-based) that answers right scores
``turn_discount ** k``; after ``max_turns`` wrong answers the episode scores 0. The feedback
(``feedback`` then the question again) is environment text: in the episode, not trained
(loss mask 0). Each answer is checked with ``reward.fn`` in the rollout worker's killable
processes. Knobs are class attributes: subclass to change them.
"""

from __future__ import annotations

from areal_async.workflows.base import EngineHandle, Episode, EpisodeBuilder, Prompt, RolloutWorkflow


class MultiTurnMath(RolloutWorkflow):
    max_turns: int = 2
    turn_discount: float = 0.5
    feedback: str = " Wrong, try again: "

    async def arun_episode(self, engine: EngineHandle, prompt: Prompt) -> Episode:
        b = EpisodeBuilder(prompt.prompt_ids)
        retry = engine.tokenizer.encode(self.feedback, add_special_tokens=False) + list(prompt.prompt_ids)
        for turn in range(self.max_turns):
            gen = await engine.generate(b.input_ids, prompt.sampling)
            b.add_generation(gen)
            answer = engine.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            if await engine.reward(answer, prompt.solutions) > 0:
                return b.finish(self.turn_discount**turn)
            if turn + 1 < self.max_turns:
                b.add_env(retry)
        return b.finish(0.0)
