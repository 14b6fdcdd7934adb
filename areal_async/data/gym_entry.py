"""The reference solution of a reasoning-gym problem: its entry as JSON (the task name, the oracle answer and
the entry's metadata), made by the data source and read back by the reward plug-in (``reward/gym_reward.py``)
in a reward child, which imports only this (json) to read it."""

from __future__ import annotations

import json

__all__ = ["encode_entry", "decode_entry", "GYM_REWARD_FN", "GYM_REWARD_FNS"]

_KEYS = ("task", "answer", "metadata")
GYM_REWARD_FN = "areal_async.reward.gym_reward:gym_reward"  # the plug-in that reads these entries
GYM_REWARD_FNS = (GYM_REWARD_FN, "areal_async.reward.gym_reward:gym_plain_reward")  # ... and its plain-text twin


def encode_entry(task: str, entry: dict) -> str:
    """The solution string of a reasoning-gym ``entry`` of ``task``; ValueError when its metadata is not JSON."""
    try:
        return json.dumps({"task": task, "answer": entry["answer"], "metadata": entry.get("metadata", {})})
    except (TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {task!r}: its entry does not serialise to JSON ({e})") from None


def decode_entry(solution: str) -> tuple[str, dict]:
    """(task, entry) of a solution made by ``encode_entry``; ValueError naming what is wrong."""
    try:
        obj = json.loads(solution)
    except (TypeError, ValueError):
        obj = None
    if not isinstance(obj, dict) or set(obj) != set(_KEYS) or not isinstance(obj["task"], str):
        raise ValueError(f"solution {solution!r:.120} is not a reasoning-gym entry {{task, answer, metadata}}")
    return obj["task"], {"answer": obj["answer"], "metadata": obj["metadata"]}
