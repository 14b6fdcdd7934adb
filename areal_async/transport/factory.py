"""Pick a tensor channel by name (``TensorChannelConfig.trajectories`` / ``.weights``).

Keyword arguments by kind (``role`` always; everything else keyword-only, unknown ones raise):

=========  ==========================================================================================
kind       trajectories (``role``: sender | receiver)       weights (``role``: publisher | receiver)
=========  ==========================================================================================
shm        endpoint, pool_mb=2048, run_id                   bucket_mb, checksum='sum64', run_id
zmq        endpoint, max_message_bytes (receiver)           bucket_mb, checksum, endpoint (publisher
                                                            bind address), expect_receivers=0
gloo       endpoint, rank, world_size, store, dst=0,        rank, world_size, store, bucket_mb,
           max_message_bytes (receiver)                     checksum, pipeline=True
nccl       as gloo, + device, rendezvous                    as gloo, + device, rendezvous
cuda_ipc   endpoint, device                                 bucket_mb, checksum='sum64', device,
                                                            n_receivers=1 (publisher), rank=1 (receiver)
=========  ==========================================================================================

``endpoint``: the ZeroMQ address the trajectory *receiver* binds and senders connect to
(``tcp://host:port`` or ``ipc:///path``); a receiver bound to port ``*`` reports the real one in
its ``.endpoint``. ``store``: the rendezvous store rank 0 serves (``transport.store``: ``tcp://host:port``, ``ipc://path``).
Implementations are imported on first use, so asking for ``shm`` never imports CUDA code and
asking for ``nccl`` on a CPU machine fails with ``TransportUnavailable`` naming what is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from areal_async.transport.base import TensorChannel, WeightChannel
from protocols.channels import CHANNEL_KINDS as KINDS

_TENSOR = {
    "shm": "shm:ShmTensorChannel",
    "zmq": "zmq_channel:ZmqTensorChannel",
    "gloo": "collective:GlooTensorChannel",
    "nccl": "nccl:NcclTensorChannel",
    "cuda_ipc": "cuda_ipc:CudaIpcTensorChannel",
}
_WEIGHT = {
    "shm": "shm_weights:ShmWeightChannel",
    "zmq": "zmq_channel:ZmqWeightChannel",
    "gloo": "collective:GlooWeightChannel",
    "nccl": "nccl:NcclWeightChannel",
    "cuda_ipc": "cuda_ipc:CudaIpcWeightChannel",
}


def _load(table: dict[str, str], kind: str) -> Any:
    if kind not in table:
        raise ValueError(f"tensor channel kind {kind!r}: expected one of {' | '.join(KINDS)}")
    module, cls = table[kind].split(":")
    return getattr(importlib.import_module(f"areal_async.transport.{module}"), cls)


def make_tensor_channel(kind: str, *, role: str, **kwargs: Any) -> TensorChannel:
    """Trajectory channel of ``kind``; ``role`` is 'sender' (rollout) or 'receiver' (trainer)."""
    if role not in ("sender", "receiver"):
        raise ValueError(f"role={role!r}: a tensor channel is a 'sender' or a 'receiver'")
    return _load(_TENSOR, kind)(role=role, **kwargs)


def make_weight_channel(kind: str, *, role: str, delta: bool = False, **kwargs: Any) -> WeightChannel:
    """Weight channel of ``kind``; ``role`` is 'publisher' (trainer) or 'receiver' (rollout); ``delta``:
    wrapped in ``delta.DeltaWeightChannel`` (``tensor_channel.weight_delta``; shm and zmq only)."""
    if role not in ("publisher", "receiver"):
        raise ValueError(f"role={role!r}: a weight channel is a 'publisher' or a 'receiver'")
    channel = _load(_WEIGHT, kind)(role=role, **kwargs)
    if not delta:
        return channel
    wrap = importlib.import_module("areal_async.transport.delta").DeltaWeightChannel
    return wrap(channel, role=role, bucket_mb=kwargs.get("bucket_mb", 64.0))
