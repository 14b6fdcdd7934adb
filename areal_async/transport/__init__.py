"""Tensor transport: trajectory and weight channels behind one small interface (see ``base``)."""

from areal_async.transport.base import (
    ProtocolError,
    TensorChannel,
    Tensors,
    TransportError,
    TransportUnavailable,
    WeightChannel,
)
from areal_async.transport.buckets import ManifestError
from areal_async.transport.factory import KINDS, make_tensor_channel, make_weight_channel

__all__ = [
    "KINDS",
    "ManifestError",
    "ProtocolError",
    "TensorChannel",
    "Tensors",
    "TransportError",
    "TransportUnavailable",
    "WeightChannel",
    "make_tensor_channel",
    "make_weight_channel",
]
