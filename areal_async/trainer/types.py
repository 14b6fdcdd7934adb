"""The trainer's input record: one generated sample with its behaviour logprobs and versions.

Covers validation of the per-token fields' lengths; does not cover transport (the rollout and
transport layers build these from their own wire messages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Trajectory:
    """One sample: prompt + generated output, as produced by a rollout worker."""

    sample_id: str
    group_id: str  # the n samples of one prompt share it
    prompt_ids: list[int]
    output_ids: list[int]
    behav_logp: list[float]  # behaviour logprobs from the rollout, one per output token
    versions: list[int]  # policy version per output token
    score: float  # task score in [0,1] before reward scaling/bias

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if not self.prompt_ids:
            raise ValueError(f"trajectory {self.sample_id!r}: empty prompt_ids; expected >= 1 prompt token")
        if n == 0:
            raise ValueError(f"trajectory {self.sample_id!r}: empty output_ids; expected >= 1 generated token")
        for name in ("behav_logp", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"trajectory {self.sample_id!r}: len({name})={got}, expected len(output_ids)={n}")

    @property
    def seq_ids(self) -> list[int]:
        """Prompt followed by output: what the trainer feeds the model."""
        return list(self.prompt_ids) + list(self.output_ids)

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any token (staleness is judged by it)."""
        return min(self.versions)
