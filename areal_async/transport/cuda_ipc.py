"""CUDA IPC channels: colocated processes sharing one GPU (trainer and rollout engine on a device).

The sender packs the tensors (or, for weights, every bucket) into one CUDA buffer - a single
device-to-device copy - and shares it with ``UntypedStorage._share_cuda_()``, the call torch's
own ``multiprocessing`` reductions use. The resulting handle is a tuple of ints, bytes and a bool;
it travels as a plain msgpack map (never pickled). The receiver rebuilds the storage with
``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and returns views of the sender's
memory: zero copies on the receiving side.

Lifetime: torch's IPC reference counter keeps a shared block alive after the sender frees it,
until every receiver has dropped its views (the sender must stay alive that long, and calls
``torch.cuda.ipc_collect()`` to reclaim blocks receivers are done with). CUDA cannot open an IPC
handle in the process that made it, so both ends must be different processes.

References: each ``_share_cuda_()`` puts the storage behind a new ``CudaIPCSentData`` whose counter
starts at one reference (torch ``csrc/StorageSharing.cpp`` ``THPStorage_shareCuda``,
``csrc/CudaIPCTypes.cpp``), and each receiver gives back exactly one when its storage dies (the
``IpcDeleterContext`` deleter of ``_new_shared_cuda``, or ``_release_ipc_counter`` when it already
holds that storage: ``torch/multiprocessing/reductions.py`` ``rebuild_cuda_tensor``). torch's own
queues therefore share once per message sent. One handle handed to N receivers would be released N
times against one reference: the block is freed while N - 1 receivers still read it. So the weight
publisher shares once per receiver (``n_receivers``) and receiver ``rank`` r (1..N) opens share r.

Placement: the receiver must see the sender's GPU, and inside one-GPU processes that means the same
GPU; ``supervisor/placement.py`` colocates every rollout worker with trainer rank 0 when
``tensor_channel.weights`` is ``cuda_ipc`` and refuses any other layout. Never run on a GPU yet.

Not covered: CPU machines (``TransportUnavailable`` at construction), different GPUs (use nccl).
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_async.transport import buckets as B
from areal_async.transport.base import TensorChannel, Tensors, TransportUnavailable, WeightChannel
from areal_async.transport.frames import ALIGN, header_bytes, layout, parse_header, tensor_views, view_as
from areal_async.transport.notify import Pipe, deadline_of
from protocols.messages import ProtocolError
from protocols.side import IpcTensors

_IPC_FIELDS = {
    "device": int,
    "handle": bytes,
    "storage_bytes": int,
    "storage_offset": int,
    "ref_handle": bytes,
    "ref_offset": int,
    "event_handle": (bytes, type(None)),
    "event_sync": bool,
    "offset": int,
    "nbytes": int,
}


def require_cuda(device: Optional[int]) -> torch.device:
    if not torch.cuda.is_available():
        raise TransportUnavailable(
            f"the 'cuda_ipc' tensor channel needs a CUDA device "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}). On CPU use 'shm' for colocated processes."
        )
    return torch.device("cuda", torch.cuda.current_device() if device is None else device)


def share(buf: torch.Tensor) -> dict:
    """Plain-data IPC handle of a CUDA uint8 tensor (its storage, plus where the tensor starts)."""
    (dev, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buf.untyped_storage()._share_cuda_()
    )
    return {
        "device": int(dev),
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": None if event_handle is None else bytes(event_handle),
        "event_sync": bool(event_sync),
        "offset": buf.storage_offset(),
        "nbytes": buf.numel(),
    }


def open_shared(ipc: object) -> torch.Tensor:
    """The uint8 tensor a ``share`` dict describes, mapped into this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(ipc, dict) or set(ipc) != set(_IPC_FIELDS):
        raise ProtocolError(f"CUDA IPC handle {ipc!r:.200}: expected fields {sorted(_IPC_FIELDS)}")
    for k, typ in _IPC_FIELDS.items():
        if not isinstance(ipc[k], typ):
            raise ProtocolError(f"CUDA IPC handle field {k!r} is {type(ipc[k]).__name__}, expected {typ}")
    torch.cuda._lazy_init()
    return rebuild_cuda_tensor(
        torch.Tensor,
        (ipc["nbytes"],),
        (1,),
        ipc["offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        ipc["device"],
        ipc["handle"],
        ipc["storage_bytes"],
        ipc["storage_offset"],
        False,
        ipc["ref_handle"],
        ipc["ref_offset"],
        ipc["event_handle"],
        ipc["event_sync"],
    )


class CudaIpcTensorChannel(TensorChannel):
    def __init__(self, *, role: str, endpoint: str, device: Optional[int] = None):
        self.device = require_cuda(device)
        self._pipe = Pipe(role, endpoint)
        self.endpoint = self._pipe.endpoint

    def send(self, key: str, tensors: Tensors, meta: Optional[dict] = None) -> None:
        header = header_bytes(key, meta or {}, tensors)
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, total = layout(sizes)
        buf = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=self.device)
        for t, off, n in zip(tensors.values(), offsets, sizes):
            if n:
                view_as(buf[off : off + n], t.dtype, list(t.shape)).copy_(t.detach())
        ipc = share(buf) if total else None
        self._pipe.send_note(IpcTensors(ipc=ipc, offsets=offsets, sizes=sizes, header=header))
        torch.cuda.ipc_collect()  # reclaim earlier buffers receivers are done with

    def recv(self, timeout_s: Optional[float] = None) -> tuple[str, dict, Tensors]:
        self._pipe.wait(deadline_of(timeout_s))
        note = self._pipe.recv_note((IpcTensors,))
        header = parse_header(note.header)
        flat = open_shared(note.ipc) if note.ipc is not None else torch.empty(0, dtype=torch.uint8, device=self.device)
        return header.key, header.meta, tensor_views(header, flat, note.offsets, note.sizes)

    def close(self) -> None:
        self._pipe.close()


class CudaIpcWeightChannel(WeightChannel):
    def __init__(
        self,
        *,
        role: str,
        bucket_mb: float = 64.0,
        checksum: str = "sum64",
        device: Optional[int] = None,
        n_receivers: int = 1,
        rank: int = 1,
    ):
        self.device = require_cuda(device)
        if role not in ("publisher", "receiver"):
            raise ValueError(f"role={role!r}: expected 'publisher' or 'receiver'")
        if n_receivers < 1 or rank < 1:
            raise ValueError(f"n_receivers={n_receivers!r}, rank={rank!r}: expected integers >= 1 (receivers are 1..N)")
        self.n_receivers, self.rank = n_receivers, rank
        if checksum not in ("sum64", "none"):
            raise ValueError(f"checksum={checksum!r}: CUDA buffers support 'sum64' or 'none'")
        self.role, self.algo = role, checksum
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buffers: dict[int, torch.Tensor] = {}

    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        lay = B.plan(state_dict, self.bucket_bytes)
        flat = torch.empty(max(lay.total, ALIGN), dtype=torch.uint8, device=self.device)
        bufs = [flat[o : o + n] for o, n in zip(lay.bucket_offsets(), lay.bucket_sizes)]
        for k, buf in enumerate(bufs):
            B.pack(lay, state_dict, k, buf)
        values = None if self.algo == "none" else [B.checksum(b, self.algo) for b in bufs]
        self._buffers[version] = flat
        shares = [share(flat) for _ in range(self.n_receivers)]  # one torch IPC reference per receiver
        return B.manifest("cuda_ipc", version, lay, self.algo, values, {"ipc": shares})

    def publish_end(self) -> None:
        """Receivers map the buffer themselves; nothing moves here."""

    @property
    def publish_end_waits(self) -> bool:
        return False

    def receive(self, manifest: dict) -> Tensors:
        lay, m = B.parse_manifest(manifest, "cuda_ipc")
        shares = m["handle"].get("ipc")
        if not isinstance(shares, list) or not 1 <= self.rank <= len(shares):
            raise B.ManifestError(
                f"cuda_ipc manifest carries {len(shares) if isinstance(shares, list) else shares!r} share(s); "
                f"receiver rank {self.rank} needs its own (the publisher's n_receivers is too small)"
            )
        flat = open_shared(shares[self.rank - 1])
        if flat.numel() != max(lay.total, ALIGN):
            raise B.ManifestError(f"cuda_ipc buffer is {flat.numel()} bytes, the manifest's buckets need {lay.total}")
        bufs = [flat[o : o + n] for o, n in zip(lay.bucket_offsets(), lay.bucket_sizes)]
        B.verify(bufs, m["checksum"]["algo"], m["checksum"]["values"], m["version"])
        return B.unflatten(lay, bufs)

    def release(self, version: int) -> None:
        self._buffers.pop(version, None)
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self._buffers.clear()
