"""The trainer's input record: one generated sample with its behaviour logprobs and versions.

Covers validation of the per-token fields' lengths; does not cover transport: the trainer builds
these from the sample views of received trajectory messages (``protocols.trajectories``, ``Trajectory.of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from protocols.trajectories import SampleView

from areal_async.trainer.packing import Segmented


@dataclass
class Trajectory:
    """One sample: prompt + generated output, as produced by a rollout worker.

    Per-token fields are 1D tensors (ids and versions int32 or int64, logprobs float32) so a
    batch packs without per-token Python work. Tensors of those dtypes are kept as given (views
    of a received message stay views: no copy here); lists and other dtypes are converted once
    (ids and versions to int64).
    """

    sample_id: str
    group_id: str  # the n samples of one prompt share it
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    behav_logp: torch.Tensor  # behaviour logprobs from the rollout, one per output token
    versions: torch.Tensor  # policy version per output token
    score: float  # task score in [0,1] before reward scaling/bias
    # per output token: 1 = trained, 0 = not (environment or tool tokens of a rollout workflow); None = all trained
    loss_mask: Optional[torch.Tensor] = None
    # output offsets where a new sequence starts (an agent's turns after template drift): the trainer restarts
    # positions and attention there (``packing.Segmented``); None = one sequence
    segment_starts: Optional[list[int]] = None

    def __post_init__(self) -> None:
        # one call per sample of every batch (8K at boba scale): tensors already of the right dtype pass
        # with a type check each (was ~4.5 us a sample with a helper call and getattr loop, now ~2)
        prompt, out, lp, vers = self.prompt_ids, self.output_ids, self.behav_logp, self.versions
        if not (isinstance(prompt, torch.Tensor) and prompt.dtype in _INT_DTYPES):
            self.prompt_ids = prompt = _int_tensor(prompt)
        if not (isinstance(out, torch.Tensor) and out.dtype in _INT_DTYPES):
            self.output_ids = out = _int_tensor(out)
        if not (isinstance(lp, torch.Tensor) and lp.dtype == torch.float32):
            self.behav_logp = lp = torch.as_tensor(lp, dtype=torch.float32)
        if not (isinstance(vers, torch.Tensor) and vers.dtype in _INT_DTYPES):
            self.versions = vers = _int_tensor(vers)
        n = out.numel()
        if prompt.numel() == 0:
            raise ValueError(f"trajectory {self.sample_id!r}: empty prompt_ids; expected >= 1 prompt token")
        if n == 0:
            raise ValueError(f"trajectory {self.sample_id!r}: empty output_ids; expected >= 1 generated token")
        if lp.numel() != n or vers.numel() != n:
            name, got = ("behav_logp", lp.numel()) if lp.numel() != n else ("versions", vers.numel())
            raise ValueError(f"trajectory {self.sample_id!r}: len({name})={got}, expected len(output_ids)={n}")
        if self.loss_mask is not None:
            self.loss_mask = torch.as_tensor(self.loss_mask).to(torch.bool)
            if self.loss_mask.numel() != n:
                raise ValueError(
                    f"trajectory {self.sample_id!r}: len(loss_mask)={self.loss_mask.numel()}, expected "
                    f"len(output_ids)={n}"
                )
            if not bool(self.loss_mask.any()):
                raise ValueError(f"trajectory {self.sample_id!r}: loss_mask trains no token; expected at least one 1")

    @classmethod
    def of(cls, view: SampleView, score: float) -> "Trajectory":
        """A received sample (views of its message's tensors, kept as views) with its score."""
        return cls(
            view.sample_id,
            view.group_id,
            view.prompt_ids,
            view.output_ids,
            view.logprobs,
            view.versions,
            float(score),
            view.loss_mask,
            view.segment_starts,
        )

    @property
    def seq_ids(self) -> torch.Tensor:
        """Prompt followed by output: what the trainer feeds the model (a new tensor)."""
        return torch.cat([self.prompt_ids, self.output_ids])

    @property
    def seq_parts(self):
        """(prompt_ids, output_ids): ``packing.pack`` copies them straight into the packed batch; with
        ``segment_starts``, the same parts as a ``Segmented`` sequence (attention restarts at each start)."""
        if not self.segment_starts:
            return self.prompt_ids, self.output_ids
        n = self.prompt_ids.numel()
        return Segmented((self.prompt_ids, self.output_ids), tuple(n + s for s in self.segment_starts))

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any trained token (staleness is judged by it)."""
        return int(self.model_versions.min())

    @property
    def model_versions(self) -> torch.Tensor:
        """Versions of the trained tokens (a workflow's environment tokens carry -1)."""
        return self.versions if self.loss_mask is None else self.versions[self.loss_mask]


_INT_DTYPES = (torch.int32, torch.int64)


def _int_tensor(x) -> torch.Tensor:
    """An int32/int64 tensor as it is; anything else (a list, another dtype) as int64."""
    if isinstance(x, torch.Tensor) and x.dtype in _INT_DTYPES:
        return x
    return torch.as_tensor(x, dtype=torch.long)
