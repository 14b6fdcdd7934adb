"""Trainer library: rewards/advantages, PPO losses, sequence packing, optimizer, actor, SFT, checkpoints.

Importable without starting processes; the trainer worker process (``workers/``) builds a
``PPOActor`` from the config and feeds it batches of ``Trajectory``.
"""

from areal_async.trainer.types import Trajectory

__all__ = ["Trajectory"]
