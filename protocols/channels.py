"""The tensor-channel kinds: the names both ends of a channel agree on, written once.

``TensorChannelConfig`` (config) refuses any other name and ``transport/factory.py`` maps each
of them to its implementation; this module holds only the names, so config validation can
import it without importing transport (torch) and transport without importing config.
"""

from __future__ import annotations

CHANNEL_KINDS: tuple[str, ...] = ("shm", "zmq", "gloo", "nccl", "cuda_ipc")
