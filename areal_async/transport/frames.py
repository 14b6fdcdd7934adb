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

from typing import Sequence

import torch

from protocols.messages import ProtocolError
from protocols.side import TensorHeader
from protocols.tensors import check_spec, header_bytes, parse_header

__all__ = ["ALIGN", "align", "flat_bytes", "header_bytes", "layout", "parse_header", "tensor_views", "view_as"]

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


def tensor_views(
    header: TensorHeader, flat: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Check every spec against the payload actually present and return views into ``flat``."""
    specs, key = header.specs, header.key
    if len(specs) != len(offsets) or len(specs) != len(sizes):
        raise ProtocolError(f"tensor message {key!r}: header lists {len(specs)} tensors, payload has {len(sizes)}")
    out: dict[str, torch.Tensor] = {}
    for spec, off, n in zip(specs, offsets, sizes):
        if off % ALIGN or off < 0 or off + n > flat.numel():
            raise ProtocolError(
                f"tensor message {key!r}: payload slice [{off}, {off + n}) is misaligned or "
                f"outside the {flat.numel()}-byte buffer"
            )
        name, dtype, shape = check_spec(spec, n, key)
        if name in out:
            raise ProtocolError(f"tensor message {key!r}: tensor name {name!r} appears twice")
        out[name] = view_as(flat[off : off + n], dtype, shape)
    return out
