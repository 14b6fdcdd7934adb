"""Process-wide settings of a worker: its log format and its torch thread count."""

from __future__ import annotations

import logging
import os
import sys


def setup_worker_logging(worker_id: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("AREAL_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format=f"%(asctime)s {worker_id} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(f"areal_async.{worker_id}")


def set_torch_threads(n: int) -> None:
    """OMP_NUM_THREADS (unless set) and torch's intra-op pool; imports torch, so call it where torch is wanted."""
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch  # heavy: only the processes that call this (trainer, rollout, sft) pay for it

    torch.set_num_threads(n)
