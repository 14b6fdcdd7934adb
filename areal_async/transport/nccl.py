"""NCCL channels through CuPy (``cupy.cuda.nccl.NcclCommunicator``): GPU to GPU, any hosts.

The same channels as gloo (``collective.py``: notes over ZeroMQ + payload by send/recv for
trajectories, pipelined bucket broadcast with an in-band checksum trailer for weights); only the
``Group`` differs. Payload is received straight into CUDA memory allocated by torch on this
rank's device; the returned tensors are views of it (no host staging, no extra copy). NCCL calls
run on the group's own stream. A send (or a broadcast from this rank) first makes that stream wait
for the work the caller has queued so far on its current stream (its bytes come from those kernels);
a receive does not wait for the caller at all: its buffer comes from ``recv_buffer``, allocated on
the group's stream, so a trainer's trajectory receive never queues behind its training kernels. The
caller's stream is recorded on a receive buffer, so freeing it later waits for the caller's kernels
that read it. ``wait`` blocks the host until the call is done (a send returns once the receiver has
the bytes, like gloo's). CuPy's API (cupy/cuda/nccl.pyx, ``NcclCommunicator.send/recv(buf pointer,
count, datatype, peer, stream pointer)``, ``bcast(buf pointer, count, datatype, root, stream pointer)``, every
count a ``size_t``: the signatures CuPy 14.2 embeds in its ``cupy_backends/cuda/libs/nccl`` module, e.g.
``NcclCommunicator.bcast(self, intptr_t buff, size_t count, int datatype, int root, intptr_t stream)``, and its
constructor ``NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)``) takes the stream as
``torch.cuda.Stream.cuda_stream``. This stream handling has not run on a GPU (no GPU was lent to the
session that wrote it); its order of calls is checked on CPU with a recording stand-in for
``torch.cuda`` (tests/unit/transport/test_nccl_streams.py), and ``scripts/gpu_check.sh`` runs it on one GPU.

Rendezvous: rank 0 creates the NCCL unique id (``nccl.get_unique_id()``, 128 bytes) and the other
ranks need it before the (collective) communicator init. Either pass ``rendezvous``, a callable
that the caller routes over the control plane - rank 0 calls ``rendezvous(uid_bytes)``, the
others ``rendezvous(None)``, and every call returns the id as bytes - or pass ``store="host:port"``
and the id travels through the same store the gloo channels use (``transport.store``).

Environment knobs that matter (read by NCCL at communicator init; set them in the launcher):

- ``NCCL_SOCKET_IFNAME``: the interface for bootstrap and socket transport (``eth0``, ``^lo``);
  a wrong default (docker bridge) is the usual cause of hangs at init across hosts.
- ``NCCL_IB_HCA``: which InfiniBand/RoCE adapters to use (``mlx5_0,mlx5_1``... one per GPU).
- ``NCCL_IB_GID_INDEX``: the RoCE GID index (often 3 for RoCE v2); wrong -> init hangs/fails.
- ``NCCL_NET_GDR_LEVEL``: how close NIC and GPU must be for GPUDirect RDMA (``PIX``, ``PXB``,
  ``PHB``, ``SYS``). Whether GPUDirect RDMA is used is NCCL's own decision from the topology and
  this knob (and needs the nvidia-peermem module); this code cannot force it, only the env can.
- ``NCCL_P2P_LEVEL``: when to use NVLink/PCIe peer-to-peer between GPUs of one host
  (``NVL`` to require NVLink); ``NCCL_P2P_DISABLE=1`` to rule it out when debugging.
- ``NCCL_DEBUG=INFO`` (``NCCL_DEBUG_SUBSYS=INIT,NET``): prints the chosen transports - look for
  ``NET/IB ... GDRDMA`` to confirm GPUDirect RDMA, ``P2P/CUMEM``/``NVLS`` for NVLink.
- ``NCCL_BUFFSIZE``, ``NCCL_NCHANNELS_PER_NET_PEER``: throughput tuning for large broadcasts.

Not covered here (CPU machines): everything past ``require_nccl``, which raises
``TransportUnavailable`` naming what is missing (cupy, NCCL, a CUDA device). The GPU tests in
``tests/gpu/test_gpu_transport.py`` exercise the rest. NCCL refuses two ranks on one GPU, so on a
single-GPU machine only single-rank groups can be built.
"""

from __future__ import annotations

import platform
from typing import Any, Callable, Optional

import torch

from areal_async.transport.base import TransportError, TransportUnavailable
from areal_async.transport.collective import (
    MAX_MESSAGE_BYTES,
    CollectiveTensorChannel,
    CollectiveWeightChannel,
    Group,
    check_rank,
)

UID_BYTES = 128
Rendezvous = Callable[[Optional[bytes]], bytes]


# The CUDA major of the gpu extra's stack (pyproject.toml `gpu-cu13`: sglang 0.5.2x pins torch 2.14.1, CUDA 13)
DEFAULT_CUDA_MAJOR = 13


def cuda_wheels(cuda_version: Optional[str]) -> tuple[str, str]:
    """(CuPy wheel, NCCL wheel) for a torch built for CUDA ``cuda_version`` (``torch.version.cuda``, e.g.
    "13.0"); without one (a CPU torch) those of the gpu extra's CUDA major."""
    major = int(str(cuda_version).split(".")[0]) if cuda_version else DEFAULT_CUDA_MAJOR
    return f"cupy-cuda{major}x", f"nvidia-nccl-cu{major}"


def require_nccl() -> Any:
    """The ``cupy.cuda.nccl`` module, or ``TransportUnavailable`` listing every missing piece (the wheels
    named for this torch's CUDA major)."""
    missing, nccl = [], None
    cupy_wheel, nccl_wheel = cuda_wheels(torch.version.cuda)
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl

        if not getattr(nccl, "available", False):
            missing.append(f"the NCCL library for CuPy (pip install {nccl_wheel})")
    except ImportError as e:
        missing.append(f"cupy (pip install {cupy_wheel}; import said: {e})")
    if not torch.cuda.is_available():
        missing.append(
            f"a CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda})"
        )
    if missing:
        raise TransportUnavailable(
            "the 'nccl' tensor channel needs "
            + "; ".join(missing)
            + ". On CPU use 'gloo' (same set-up and calls) or 'shm'/'zmq'."
        )
    return nccl


def uid_to_bytes(uid: tuple | bytes) -> bytes:
    """The 128 id bytes, from CuPy's tuple of signed/unsigned chars (<= 13) or its bytes (>= 14)."""
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(x & 0xFF for x in uid)


def uid_from_bytes(b: bytes) -> tuple:
    """CuPy wants the C ``char`` values back: signed on x86-64, unsigned on aarch64."""
    if not isinstance(b, (bytes, bytearray)) or len(b) != UID_BYTES:
        raise TransportError(
            f"NCCL unique id must be {UID_BYTES} bytes, got {type(b).__name__} of {len(b) if b else 0}"
        )
    if platform.machine() in ("aarch64", "arm64"):
        return tuple(b)
    return tuple(x - 256 if x > 127 else x for x in b)


def communicator(nccl, world_size: int, uid: bytes, rank: int):
    """``NcclCommunicator`` with the unique id in the form this CuPy takes: a tuple of C ``char``
    values (CuPy <= 13, whose ``get_unique_id`` returns a tuple) or ``bytes`` (CuPy >= 14, whose
    ``get_unique_id`` returns bytes). Cython refuses the other form with TypeError before NCCL
    is touched, so trying the tuple first and then the bytes costs nothing."""
    try:
        return nccl.NcclCommunicator(world_size, uid_from_bytes(uid), rank)
    except TypeError as first:
        try:
            return nccl.NcclCommunicator(world_size, bytes(uid), rank)
        except TypeError:
            raise TypeError(f"NcclCommunicator took the unique id neither as a tuple ({first}) nor as bytes") from None


class CudaStreams:
    """What ``NcclGroup`` asks of CUDA streams: ``torch.cuda``'s stream API, one method per use."""

    def new(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def record(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)


class NcclGroup(Group):
    name = "nccl"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Optional[str] = None,
        rendezvous: Optional[Rendezvous] = None,
        device: Optional[int] = None,
        name: str,
        timeout_s: float = 300.0,
    ):
        self.nccl = require_nccl()
        check_rank(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        torch.cuda.set_device(self.device)
        uid = self._unique_id(store, rendezvous, name, timeout_s)
        import cupy

        with cupy.cuda.Device(self.device.index):
            self.comm = communicator(self.nccl, world_size, uid, rank)
        self.use_streams(CudaStreams())

    def use_streams(self, streams: "CudaStreams") -> None:
        """The stream API (``torch.cuda``'s, or a recording stand-in in CPU tests) and this group's own stream."""
        self.streams = streams
        self.stream = streams.new(self.device)

    def _unique_id(self, store: Optional[str], rendezvous: Optional[Rendezvous], name: str, timeout_s: float) -> bytes:
        mine = uid_to_bytes(self.nccl.get_unique_id()) if self.rank == 0 else None
        if rendezvous is not None:
            return rendezvous(mine)
        if store is None:
            raise ValueError("the nccl channel needs store='tcp://host:port' (or ipc://) or a rendezvous callable")
        from areal_async.transport.store import group_store  # pyzmq: only where the id goes through the store

        s = group_store(store, self.rank, timeout_s)
        key = f"areal/{name}/nccl_unique_id"
        if mine is not None:
            s.set(key, mine)
            return mine
        return s.get(key)

    def _launch(self, bufs: list[torch.Tensor], call: Callable[[int], None], after_caller: bool) -> Any:
        """``call(stream pointer)`` on this group's stream; the returned event marks its end. ``after_caller``:
        the op reads bytes that the caller's queued kernels produce (a send, a broadcast from this rank)."""
        if after_caller:
            self.stream.wait_stream(self.streams.current(self.device))
        for b in bufs:  # the caching allocator must not hand these out while NCCL still uses them
            self.streams.record(b, self.stream)
        with self.streams.use(self.stream):
            call(self.stream.cuda_stream)
            done = self.streams.event()
            done.record(self.stream)
        return done

    def recv_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer to receive into, allocated on this group's stream (so the receive need not wait for the
        caller's stream); the caller's stream is recorded on it, as the caller reads what arrives."""
        with self.streams.use(self.stream):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.streams.record(buf, self.streams.current(self.device))
        return buf

    def send(self, bufs: list[torch.Tensor], dst: int) -> Any:
        return self._launch(bufs, lambda s: self._grouped(bufs, self.comm.send, dst, s), after_caller=True)

    def recv(self, bufs: list[torch.Tensor], src: int) -> Any:
        """Into buffers from ``recv_buffer`` (not ordered after the caller's stream)."""
        return self._launch(bufs, lambda s: self._grouped(bufs, self.comm.recv, src, s), after_caller=False)

    def _grouped(self, bufs: list[torch.Tensor], op: Callable, peer: int, stream: int) -> None:
        """``op(buf pointer, count, NCCL_UINT8, peer, stream pointer)`` for each buffer, in one NCCL group."""
        self.nccl.groupStart()  # one fused launch for all tensors of a message
        try:
            for b in bufs:
                op(b.data_ptr(), b.numel(), self.nccl.NCCL_UINT8, peer, stream)
        finally:
            self.nccl.groupEnd()

    def broadcast(self, buf: torch.Tensor, root: int) -> Any:
        """From ``buf`` at ``root`` (after the caller's queued work), into ``buf`` (a ``recv_buffer``) elsewhere."""
        u8 = self.nccl.NCCL_UINT8
        return self._launch(
            [buf], lambda s: self.comm.bcast(buf.data_ptr(), buf.numel(), u8, root, s), after_caller=self.rank == root
        )

    def wait(self, handle: Any) -> None:
        handle.synchronize()

    def close(self) -> None:
        if getattr(self, "comm", None) is not None:
            self.stream.synchronize()
            self.comm.destroy()
            self.comm = None


class NcclTensorChannel(CollectiveTensorChannel):
    def __init__(
        self,
        *,
        role: str,
        endpoint: str,
        rank: int,
        world_size: int,
        store: Optional[str] = None,
        rendezvous: Optional[Rendezvous] = None,
        device: Optional[int] = None,
        dst: int = 0,
        name: str = "trajectories",
        timeout_s: float = 300.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        group = NcclGroup(
            rank=rank,
            world_size=world_size,
            store=store,
            rendezvous=rendezvous,
            device=device,
            name=name,
            timeout_s=timeout_s,
        )
        super().__init__(group, role=role, endpoint=endpoint, dst=dst, max_message_bytes=max_message_bytes)


class NcclWeightChannel(CollectiveWeightChannel):
    def __init__(
        self,
        *,
        role: str,
        rank: int,
        world_size: int,
        store: Optional[str] = None,
        rendezvous: Optional[Rendezvous] = None,
        device: Optional[int] = None,
        bucket_mb: float = 64.0,
        checksum: str = "sum64",
        pipeline: bool = True,
        name: str = "weights",
        timeout_s: float = 300.0,
    ):
        group = NcclGroup(
            rank=rank,
            world_size=world_size,
            store=store,
            rendezvous=rendezvous,
            device=device,
            name=name,
            timeout_s=timeout_s,
        )
        super().__init__(group, role=role, bucket_mb=bucket_mb, checksum=checksum, pipeline=pipeline)
