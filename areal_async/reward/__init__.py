"""Reward: the boba math reward (``math_verify_reward``) and a pool of killable processes that
runs any reward function named by dotted path (``pool.RewardPool``).

Attributes load lazily (PEP 562): a reward child process imports this package on its way to
``_child`` and should pay only for what its reward function needs (math-verify/sympy take ~1 s).
"""

from __future__ import annotations

import importlib

__all__ = ["DEFAULT_REWARD_FN", "RewardOutcome", "RewardPool", "boxed_math_reward", "extract_boxed"]

_HOME = {
    "DEFAULT_REWARD_FN": "pool",
    "RewardOutcome": "pool",
    "RewardPool": "pool",
    "boxed_math_reward": "math_verify_reward",
    "extract_boxed": "math_verify_reward",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
