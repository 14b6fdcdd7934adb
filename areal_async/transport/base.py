"""Tensor channels: the one interface bulk tensors move through (trajectories and weights).

Two roles, two small abstract bases:

- ``TensorChannel`` (point to point, rollout -> trainer): ``send(key, tensors, meta)`` on the
  sender, ``recv(timeout_s) -> (key, meta, tensors)`` on the receiver (``TimeoutError`` when
  nothing arrived in time; ``TransportError``/``ProtocolError`` for a bad message, after which the
  channel keeps working).
- ``WeightChannel`` (one publisher, many receivers): the publisher calls ``publish_begin(version,
  state_dict) -> manifest`` (plain msgpack-able data), ships the manifest on the control plane
  (``protocols.messages.WeightsPublished``), then ``publish_end()``; each receiver calls
  ``receive(manifest)``, which checks names, dtypes, shapes and checksums before returning.
  For the collectives (gloo, nccl) the bytes move while the publisher is in ``publish_end`` and
  the receivers are in ``receive``; for shm/zmq/cuda_ipc ``publish_end`` returns at once.

Implementations are picked by name (``areal_async.transport.make_tensor_channel``); see
``factory.py`` for the keyword arguments each kind takes. Usage::

    from areal_async.transport import make_weight_channel
    tc = cfg.tensor_channel                              # TensorChannelConfig
    # trainer (rank 0 of the transport group)
    pub = make_weight_channel(tc.weights, role="publisher", bucket_mb=tc.bucket_mb, **group)
    manifest = pub.publish_begin(version, model.state_dict())
    control.send(WeightsPublished(version=version, manifest=manifest))
    pub.publish_end()                  # collectives broadcast here; no-op for shm
    pub.release(version - 1)           # old versions' segments/buffers go away
    # rollout worker (ranks 1..N), on receiving the WeightsPublished message
    sub = make_weight_channel(tc.weights, role="receiver", **group)
    engine.update_weights(msg.version, sub.receive(msg.manifest))  # raises TransportError if incomplete

``group`` is ``{}`` for shm/zmq/cuda_ipc and ``dict(rank=r, world_size=n, store="host:port")``
for gloo/nccl (rank 0 = trainer; rank 0 hosts the rendezvous store).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from protocols.messages import ProtocolError

Tensors = dict[str, torch.Tensor]


class TransportError(RuntimeError):
    """A transfer failed or delivered something other than what was announced."""


class TransportUnavailable(RuntimeError):
    """This channel kind cannot run here (missing package or device); the message says which."""


class TensorChannel(ABC):
    """Point-to-point tensor messages; an instance is either a sender or a receiver."""

    @abstractmethod
    def send(self, key: str, tensors: Tensors, meta: Optional[dict] = None) -> None:
        """Deliver ``tensors`` under ``key``; the caller must not modify them until it returns."""

    @abstractmethod
    def recv(self, timeout_s: Optional[float] = None) -> tuple[str, dict, Tensors]:
        """Next message; ``TimeoutError`` after ``timeout_s`` (None waits forever)."""

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Free sockets, segments and groups; idempotent."""


class WeightChannel(ABC):
    """Versioned state dicts from one publisher to any number of receivers.

    ``phases``: seconds of the last publish's (publisher) or receive's (receiver) steps by name,
    for the channels that time them (shm, gloo/nccl); empty otherwise."""

    phases: dict[str, float] = {}  # instances assign their own dict; never mutated in place

    @abstractmethod
    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        """Lay out (and, where the bytes do not move in ``publish_end``, copy) the weights."""

    @abstractmethod
    def publish_end(self) -> None:
        """Return once the payload is out (the broadcast, for collectives)."""

    @property
    def publish_end_waits(self) -> bool:
        """Whether ``publish_end`` may wait for receivers (a broadcast, awaited fetches); False where
        it returns at once, so a publisher may call it without a thread to wait in."""
        return True

    @abstractmethod
    def receive(self, manifest: dict) -> Tensors:
        """Every tensor of the manifest, verified; ``TransportError`` otherwise."""

    def release(self, version: int) -> None:  # noqa: B027 (optional: a no-op by default)
        """Free what ``version`` still holds (segments, buffers); unknown versions are ignored."""

    def prewarm(self, versions: int) -> None:  # noqa: B027 (optional: a no-op by default)
        """Publisher, after a first ``publish_end``: get room for ``versions`` versions of the last
        one's size held at once, in the background, so later publications find it warm (shm: its
        pooled segments). A no-op where a channel's buffers are already warm after one version."""

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Release everything; idempotent."""


__all__ = ["ProtocolError", "TensorChannel", "Tensors", "TransportError", "TransportUnavailable", "WeightChannel"]
