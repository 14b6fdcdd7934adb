"""Shared test set-up: CPU only, one torch thread per process (2-core machines)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
