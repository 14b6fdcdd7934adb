"""Trainer library: rewards/advantages, PPO losses, sequence packing, optimizer, actor, SFT, checkpoints.

Importable without starting processes; the trainer worker process (``workers/``) builds a
``PPOActor`` from the config and feeds it batches of ``Trajectory`` (``protocols.trajectories``).
The package root imports nothing: the supervisor reads ``checkpoint_dirs`` (torch-free) through it,
and ``areal-async run`` must refuse a bad config without loading torch.
"""
