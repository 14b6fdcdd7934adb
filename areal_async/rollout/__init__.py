"""Rollout engines: the ``RolloutEngine`` seam (``engine``) and the embedded ``TorchEngine``."""

from areal_async.rollout.engine import GenRequest, GroupOutput, RolloutEngine, SampleOutput

__all__ = ["GenRequest", "GroupOutput", "RolloutEngine", "SampleOutput"]
