"""Rollout workflows: the seam (``base``: ``RolloutWorkflow``, ``EngineHandle``, ``Episode``) and the
shipped workflows (``multi_turn_math``, ``calculator``). Torch-free: a workflow's tokens are lists.
"""

from areal_async.workflows.base import (
    EngineHandle,
    Episode,
    EpisodeBuilder,
    Generation,
    Prompt,
    RolloutWorkflow,
    Sampling,
    SingleTurn,
)

__all__ = [
    "EngineHandle",
    "Episode",
    "EpisodeBuilder",
    "Generation",
    "Prompt",
    "RolloutWorkflow",
    "Sampling",
    "SingleTurn",
]
