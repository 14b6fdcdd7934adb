"""The trainer: its process (``service``), the PPO actor, SFT steps, the trajectory buffer and plan book.

Subrooms, lowest floor first: ``algo`` (rewards/advantages, PPO losses, corrections, the mismatch block),
then ``compute`` (packing, the packed forward and logprobs, micro-batches, optimizer, data-parallel ranks)
beside ``persist`` (checkpoints, the final model, the record and recording of what was trained).
Importable without starting processes; the trainer worker process (``workers/``) builds a ``PPOActor``
from the config and feeds it batches of ``Trajectory`` (``protocols.trajectories``). The package roots
import nothing: the supervisor reads ``persist.checkpoint_dirs`` (torch-free) through them, and
``areal-async run`` must refuse a bad config without loading torch.
"""
