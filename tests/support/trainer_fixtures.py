"""Trainer inputs shared by the trainer's unit tests and its data-parallel ranks (tests/contract/test_trainer_dp.py,
whose spawned ranks import it too)."""

import torch

from protocols.trajectories import Trajectory


def make_trajs():
    """Uneven lengths (so the ranks' token shares differ), 3 groups, behaviour logprobs off the
    policy by a fixed pattern so that importance weights vary and some tokens are rejected."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k, (n_p, n_o) in enumerate([(3, 20), (2, 4), (4, 9), (3, 3), (2, 14), (5, 2), (3, 7)]):
        prompt = torch.randint(1, 16, (n_p,), generator=g).tolist()
        output = torch.randint(1, 16, (n_o,), generator=g).tolist()
        behav = (-2.5 + 0.8 * torch.randn(n_o, generator=g)).tolist()
        out.append(Trajectory(f"s{k}", f"g{k % 3}", prompt, output, behav, [0] * n_o, float(k % 2)))
    return out
