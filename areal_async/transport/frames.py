"""Tensor headers and zero-copy views, shared by the channels that move payload out of band.

The header is the one of ``protocols.tensors`` (the ``protocols.side.TensorHeader`` message, each
spec ``{name, dtype, shape, nbytes}``), built and parsed by the same functions, so every
channel rejects the same malformed headers with the same ``ProtocolError``. What differs here:
the payload is one flat uint8 buffer (a shared-memory slab, a gloo/NCCL receive buffer, a CUDA
IPC allocation) with each tensor at a 64-byte aligned offset, and tensors come back as *views*
of that buffer instead of copies (``protocols.tensors.decode_tensors`` copies into new memory,
which is right for ZeroMQ frames but would be a second memcpy for shared memory).

Covered: CPU and CUDA tensors of the dtypes in ``protocols.tensors.DTYPES``, empty and 0-d ones.
Not covered: non-dense layouts (sparse, nested); they are rejected by ``spec_of``.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

from protocols.messages import ProtocolError
from protocols.side import TensorHeader
from protocols.tensors import check_spec, header_bytes, parse_header

__all__ = [
    "ALIGN",
    "align",
    "flat_bytes",
    "header_bytes",
    "layout",
    "np_view_as",
    "parse_header",
    "tensor_views",
    "view_as",
]

ALIGN = 64  # cache line; also a multiple of every element size, so dtype views are legal


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Aligned offsets for payloads of ``sizes`` bytes, and the total buffer size."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += align(n)
    return offsets, pos


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (a copy only when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def view_as(flat: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Reinterpret an aligned uint8 slice as ``dtype[shape]`` without copying."""
    if flat.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=flat.device)
    return flat.view(dtype).reshape(shape)


# torch dtype -> (numpy dtype of the same size, torch dtype to view the result as when numpy has none)
_NP_OF: dict[torch.dtype, tuple[type, torch.dtype | None]] = {
    torch.float32: (np.float32, None),
    torch.float64: (np.float64, None),
    torch.float16: (np.float16, None),
    torch.bfloat16: (np.int16, torch.bfloat16),
    torch.int64: (np.int64, None),
    torch.int32: (np.int32, None),
    torch.int16: (np.int16, None),
    torch.int8: (np.int8, None),
    torch.uint8: (np.uint8, None),
    torch.bool: (np.bool_, None),
}


def np_view_as(flat: np.ndarray, off: int, n: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A ``dtype[shape]`` tensor over bytes ``[off, off + n)`` of a uint8 numpy buffer, without copying.

    Built with numpy slicing and ``torch.from_numpy``: ~1.5 us a tensor against ~5 us for torch's
    slice + view + reshape (measured here), which counts at one call per tensor of every message.
    The tensor keeps the numpy array (and so ``flat``) alive."""
    np_dtype, alias = _NP_OF[dtype]
    t = torch.from_numpy(flat[off : off + n].view(np_dtype).reshape(shape))
    return t if alias is None else t.view(alias)


def tensor_views(
    header: TensorHeader,
    flat: Union[torch.Tensor, np.ndarray],
    offsets: Sequence[int],
    sizes: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Check every spec against the payload actually present and return views into ``flat`` (a
    uint8 tensor, or a uint8 numpy array for host memory: the views are then made by ``np_view_as``)."""
    specs, key = header.specs, header.key
    if len(specs) != len(offsets) or len(specs) != len(sizes):
        raise ProtocolError(f"tensor message {key!r}: header lists {len(specs)} tensors, payload has {len(sizes)}")
    host = isinstance(flat, np.ndarray)
    have = flat.size if host else flat.numel()
    out: dict[str, torch.Tensor] = {}
    for spec, off, n in zip(specs, offsets, sizes):
        if off % ALIGN or off < 0 or off + n > have:
            raise ProtocolError(
                f"tensor message {key!r}: payload slice [{off}, {off + n}) is misaligned or "
                f"outside the {have}-byte buffer"
            )
        name, dtype, shape = check_spec(spec, n, key)
        if name in out:
            raise ProtocolError(f"tensor message {key!r}: tensor name {name!r} appears twice")
        out[name] = np_view_as(flat, off, n, dtype, shape) if host else view_as(flat[off : off + n], dtype, shape)
    return out


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` on the host with one device-to-host copy per device buffer they view: a message received
    into GPU memory (its tensors are views of one flat buffer, ``tensor_views``) costs one copy in all, not
    one per tensor. Host tensors are returned as they are (no copy)."""
    if all(t.is_cpu for t in tensors.values()):
        return tensors
    host: dict[tuple, torch.Tensor] = {}  # (device, buffer address, bytes) -> the buffer's bytes on the host
    out = {}
    for name, t in tensors.items():
        if t.is_cpu:
            out[name] = t
            continue
        s = t.untyped_storage()
        key = (t.device, s.data_ptr(), s.nbytes())
        if key not in host:
            host[key] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s).to("cpu")
        out[name] = torch.empty(0, dtype=t.dtype).set_(
            host[key].untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )
    return out
