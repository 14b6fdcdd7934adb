"""Tensor frames: a named set of tensors as one msgpack header frame plus one raw frame each.

``encode_tensors(key, meta, tensors)`` returns ``[header, raw_0, raw_1, ...]``. The raw frames
are memoryviews of the tensors' own (contiguous, CPU) storage, so ZeroMQ can send them without
a copy (``send_multipart(frames, copy=False)``). The header says, for every tensor, its name,
dtype, shape and byte count; ``decode_tensors`` checks all of them against the frames it got
(count, sizes, dtype whitelist, the declared total against the receiver's bound) and raises
``ProtocolError`` naming the first mismatch before it allocates any tensor, so a truncated,
padded or mislabelled frame never becomes a silently wrong tensor.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from protocols.messages import ProtocolError, decode, encode
from protocols.side import TensorHeader


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor without copying when it is already contiguous."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor frames carry CPU tensors; got one on {t.device} (use a GPU channel)")
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def spec_of(name: str, t: torch.Tensor) -> dict:
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
    return {"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}


def header_bytes(key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """The ``TensorHeader`` frame describing ``tensors`` (on any device)."""
    return encode(TensorHeader(key=key, meta=meta, specs=[spec_of(n, t) for n, t in tensors.items()]))


def encode_tensors(key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> list:
    return [header_bytes(key, meta, tensors)] + [tensor_bytes(t) for t in tensors.values()]


def decode_tensors(frames: Sequence[Any], max_bytes: Optional[int] = None) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """[header, raw...] -> (key, meta, {name: tensor}); tensors own their memory. Nothing is allocated
    before every frame matched its spec (a frame larger or smaller than declared is refused) and the
    declared total is within ``max_bytes`` (when given)."""
    if not frames:
        raise ProtocolError("tensor message has no frames")
    header = parse_header(_buf(frames[0]))
    specs = header.specs
    if len(frames) - 1 != len(specs):
        raise ProtocolError(
            f"tensor message {header.key!r}: header lists {len(specs)} tensors, got {len(frames) - 1} frames"
        )
    declared = sum(s.get("nbytes", 0) for s in specs if isinstance(s, dict) and isinstance(s.get("nbytes"), int))
    if max_bytes is not None and declared > max_bytes:
        raise ProtocolError(
            f"tensor message {header.key!r}: header declares {declared} bytes, more than the bound {max_bytes}"
        )
    bufs = [_buf(f) for f in frames[1:]]
    checked = [check_spec(spec, len(buf), header.key) for spec, buf in zip(specs, bufs)]
    out = {}
    for (name, dtype, shape), buf in zip(checked, bufs):
        if name in out:
            raise ProtocolError(f"tensor message {header.key!r}: tensor name {name!r} appears twice")
        out[name] = torch.empty(shape, dtype=dtype) if len(buf) == 0 else _copy(buf, dtype, shape)
    return header.key, header.meta, out


def _buf(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def parse_header(buf: bytes | memoryview) -> TensorHeader:
    """The validated header frame (version, type, fields and their types); ``ProtocolError`` if not."""
    return decode(buf, (TensorHeader,))


def check_spec(spec: Any, have: int, key: str) -> tuple[str, torch.dtype, list[int]]:
    """(name, dtype, shape) of one spec whose payload has ``have`` bytes; ``ProtocolError`` if off.
    Shared by every channel so all of them reject the same malformed specs the same way."""
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape", "nbytes"}:
        raise ProtocolError(f"tensor message {key!r}: malformed spec {spec!r}")
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: unsupported dtype {dtype!r}, expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if spec["nbytes"] != want or have != want:
        raise ProtocolError(
            f"tensor {name!r}: {dtype}{shape} needs {want} bytes; header says {spec['nbytes']}, payload has {have}"
        )
    return name, DTYPES[dtype], shape


def _copy(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
