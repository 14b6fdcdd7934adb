"""The GPU checks of ``scripts/gpu_check.sh`` as tests (``-m gpu`` on a CUDA machine): each check that needs
CUDA must pass (NCCL group loopback and weight publish through the project's classes, trajectories from GPU
memory to the host, the FSDP2 step equal to the plain step, DCP round trip and HF export). The thresholds
and what each check asserts are in benchmarks/gpu_check. Collects without pyzmq (the runner imports nothing
of the project; a check's module is imported when it runs, in its own process)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check.registry import CHECKS, run_check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("check", [c for c in CHECKS if c.needs_cuda], ids=lambda c: c.name)
def test_gpu_check_passes(check):
    """Passes, or skips for a package or environment the box lacks (``registry.missing``: pyzmq for the run)."""
    row = run_check(check, cuda=True)
    if row["status"] == "skipped" and check.needs:
        pytest.skip(row["detail"])
    assert row["status"] == "pass", row
