"""The weight-update process group an SGLang server joins, built the way SGLang builds it.

SGLang's ``POST /init_weights_update_group`` makes the server call
``sglang.srt.utils.init_custom_process_group(backend, init_method="tcp://addr:port",
world_size, rank=rank_offset + tp_rank, group_name)``: a TCP rendezvous at the master address
(rank 0 hosts the store: here bound to that address only, ``bound_store``), the store wrapped in
``PrefixStore(group_name, store)``, and a process group made by torch's ``_new_process_group_helper``,
outside the default group. The party that sends weights (rank 0) must build its side the same way:
a plain ``init_process_group`` uses other store keys, never meets the server, and both sides hang
until their timeouts.

``init_custom_group`` below repeats those steps (read from sglang 0.5.23,
``srt/utils/common.py``), so rank 0 here and a real SGLang server (NCCL) or the CPU server
(gloo, ``servers/sglang_server.py``, which calls this same function) meet in one group.
``flattened_buckets`` lays a state dict out as SGLang's ``FlattenedTensorBucket`` expects it:
tensors back to back, each at a byte offset that is a multiple of its item size (the receiver
recomputes offsets from names/dtypes/shapes and refuses an unaligned one).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch


def init_custom_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
):
    """A process group of ``world_size`` ranks under ``group_name``; blocks until all ranks joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not group_name:
        raise ValueError("group_name='': expected a non-empty name (SGLang refuses an empty one)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an int in [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the store's server: on master_address only (rendezvous' TCPStore would listen on '*')
        store = bound_store(master_address, int(master_port), world_size, timeout)
    else:
        init_method = f"tcp://{_host(master_address)}:{int(master_port)}"
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def bound_store(host: str, port: int, world_size: int, timeout: datetime.timedelta):
    """Rank 0's side of the ``tcp://host:port`` rendezvous SGLang's server joins: the TCPStore that torch's
    ``rendezvous`` makes (``_create_c10d_store``: world_size, waits for the workers), but serving a socket
    bound to ``host`` here (``master_listen_fd``; the store takes the descriptor over and closes it), since
    ``TCPStore(host, port, is_master=True)`` listens on every interface. SGLang's side cannot authenticate
    (torch's protocol has none); the group name, which prefixes every key of the group, is a per-group
    secret sent only in the key-authenticated ``/init_weights_update_group``, so a blind joiner of the
    store cannot take a rank (it can still count itself into the wait or fill the port: loopback by default)."""
    import socket

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    return dist.TCPStore(
        host, port, world_size, True, timeout, wait_for_workers=True, master_listen_fd=fd, use_libuv=True
    )


def destroy_group(pg) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError):
        pass  # already gone (a peer died); nothing else holds it


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


@dataclass
class Bucket:
    """One ``POST /update_weights_from_distributed`` and the broadcast that goes with it."""

    names: list[str]
    dtypes: list[str]  # "float32", "bfloat16" (SGLang does getattr(torch, dtype): no "torch." prefix)
    shapes: list[list[int]]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def flat(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The bytes rank 0 broadcasts: tensors back to back, as FlattenedTensorBucket packs them; written into
        the front of ``out`` (uint8, >= ``nbytes``, on any device) when given, and that view returned. A buffer
        kept across buckets and versions is written without page faults: a fresh tensor per 64 MiB bucket cost
        6x the copy (0.13B, 242 MiB: 145-165 ms vs 23 ms into a kept buffer, one thread).

        Each tensor is copied into its slice of ``out`` (``copy_`` crosses devices: a CUDA tensor lands in a
        host buffer as one device-to-host copy). ``torch.cat(parts, out=...)`` cannot do that: cat is a structured
        kernel whose generated ``resize_out`` refuses an out tensor on another device than its inputs
        (torchgen/dest/register_dispatch_key.py, torch 2.13: "Expected out tensor to have device ...")."""
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors]
        if out is None:
            return torch.cat(parts)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.nbytes:
            raise ValueError(f"out: {out.dtype} {tuple(out.shape)}, expected a 1-D uint8 tensor of >= {self.nbytes}")
        at = 0
        for p in parts:
            out[at : at + p.numel()].copy_(p)
            at += p.numel()
        return out[: self.nbytes]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flattened_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Split ``state_dict`` into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own).

    Inside a bucket tensors go by item size, largest first: item sizes are powers of two, so
    every offset is then a multiple of the next tensor's item size without any padding.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected an int >= 1")
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    out = []
    for items in buckets:
        if not items:
            continue
        items = sorted(items, key=lambda kv: -kv[1].element_size())  # stable: same-size tensors keep their order
        out.append(
            Bucket(
                [k for k, _ in items],
                [dtype_name(t.dtype) for _, t in items],
                [list(t.shape) for _, t in items],
                [t for _, t in items],
            )
        )
    return out


def unflatten(
    names: list[str], dtypes: list[str], shapes: list[list[int]], flat: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The receiver's side (FlattenedTensorBucket.empty + reconstruct_tensors): views into ``flat``."""
    out, offset = {}, 0
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dt, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {dt!r} of {name!r}: expected a torch dtype name such as 'float32'")
        if offset % dtype.itemsize:
            raise ValueError(
                f"tensor {name!r} starts at byte {offset}, not a multiple of its item size {dtype.itemsize}"
            )
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[name] = flat[offset : offset + n].view(dtype).reshape(shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, the names/dtypes/shapes describe {offset}")
    return out


def bucket_size(dtypes: list[str], shapes: list[list[int]]) -> int:
    return sum(int(torch.Size(s).numel()) * getattr(torch, d).itemsize for d, s in zip(dtypes, shapes, strict=True))
