"""One workflow episode in a process of its own, for ``check-plugin`` (``python -m ... PATH``).

Prints ``{"ready": true}`` once the plug-in is loaded and built, then runs one episode against a
random-token engine handle and prints one JSON verdict line ``{"ok": bool, "message": str}``.
The parent kills this process if the episode outlasts its timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

from areal_async.base.plugins import load_callable
from areal_async.workflows.base import EngineHandle, Episode, Generation, Prompt, Sampling

VOCAB = 128


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class RandomEngine(EngineHandle):
    """Random tokens, logprobs and version 0: enough to exercise a workflow's control flow."""

    def __init__(self, seed: int = 0):
        self.tokenizer, self.rng, self.calls = ByteTokenizer(), random.Random(seed), 0

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        if not input_ids or not all(isinstance(i, int) and 0 <= i < VOCAB for i in input_ids):
            raise ValueError(f"generate: input_ids={input_ids!r:.80} must be a non-empty list of ids in [0, {VOCAB})")
        self.calls += 1
        n = self.rng.randint(1, sampling.max_new_tokens)
        ids = [self.rng.randrange(32, VOCAB) for _ in range(n)]
        return Generation(ids, [-self.rng.random() * 3 for _ in ids], [0] * n, "length")

    async def reward(self, completion: str, solutions: list[str]) -> float:
        return float(self.rng.random() < 0.5)


def _verdict(path: str, episode) -> dict:
    if not isinstance(episode, Episode):
        return {
            "ok": False,
            "message": f"wrong return type: workflow {path!r} returned {type(episode).__name__} "
            f"{episode!r:.60}; expected an Episode (areal_async.workflows.base)",
        }
    why = episode.problem()
    if why:
        return {"ok": False, "message": f"bad episode: workflow {path!r} returned an Episode whose {why}"}
    return {
        "ok": True,
        "message": f"ok: workflow {path!r} ran an episode of {episode.turns} turn(s), "
        f"{sum(episode.loss_mask)}/{len(episode.loss_mask)} output tokens trained, "
        f"reward {episode.reward:g}",
    }


async def _episode(path: str, out) -> dict:
    cls = load_callable(path)
    try:
        workflow = cls()
    except Exception as e:
        return {
            "ok": False,
            "message": f"raises: building workflow {path!r} with no arguments raised {type(e).__name__}: {e}",
        }
    engine = RandomEngine()
    prompt = Prompt("check-0", ByteTokenizer().encode("7 + 5 = "), ["12"], Sampling(max_new_tokens=8))
    print(json.dumps({"ready": True}), file=out, flush=True)
    try:
        episode = await workflow.arun_episode(engine, prompt)
    except Exception as e:
        return {"ok": False, "message": f"raises: workflow {path!r} raised {type(e).__name__}: {e} in arun_episode"}
    return _verdict(path, episode)


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w")  # the verdict channel; a print() in the plug-in goes to stderr
    os.dup2(2, 1)
    print(json.dumps(asyncio.run(_episode(argv[0], out))), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
