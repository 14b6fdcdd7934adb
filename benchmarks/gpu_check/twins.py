"""CPU stand-ins for the GPU pieces the NCCL checks drive, so the same check code runs here (``--cpu-twins``).

``loopback_group()`` is an ``NcclGroup`` of one rank on the host whose CuPy module and communicator are
``LoopbackNccl`` / ``LoopbackComm`` and whose streams are ``HostStreams``. The communicator takes CuPy 14.2's
arguments (its embedded signatures: ``send/recv(self, intptr_t buf, size_t count, int datatype, int peer, intptr_t
stream)``, ``bcast(self, intptr_t buff, size_t count, int datatype, int root, intptr_t stream)``) and refuses what
NCCL refuses on one rank: a send to oneself completes only when its receive is in the same group (outside a group
NCCL waits forever; here: ``RuntimeError``), the sizes of a matched send and receive must be equal, and a
broadcast of one rank leaves the root's buffer as it is. Matched pairs are copied at the outermost ``groupEnd``
(``ncclGroupEnd`` launches the group), byte for byte with ``ctypes.memmove`` between the host pointers.

What the twin cannot show: device memory, streams running concurrently, NCCL's transports. Those are the GPU
run's (``scripts/gpu_check.sh`` on a CUDA box).
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

from areal_async.transport.nccl import NcclGroup


class HostStream:
    cuda_stream = 0

    def wait_stream(self, other: "HostStream") -> None:
        pass  # host work is already in order

    def synchronize(self) -> None:
        pass


class HostEvent:
    def record(self, stream: HostStream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostStreams:
    """``nccl.CudaStreams`` on the host: one stream, every call in program order."""

    def new(self, device):
        return HostStream()

    def current(self, device):
        return HostStream()

    def use(self, stream):
        return contextlib.nullcontext()

    def event(self):
        return HostEvent()

    def record(self, t: torch.Tensor, stream) -> None:
        pass


class LoopbackComm:
    """A one-rank communicator (see the module docstring)."""

    def __init__(self, nccl: "LoopbackNccl"):
        self.nccl = nccl

    def _peer(self, peer: int) -> None:
        if peer != 0:
            raise RuntimeError(f"peer {peer} in a communicator of one rank (NCCL: ncclInvalidArgument)")

    def send(self, buf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._peer(peer)
        self.nccl.pending("send", buf, count)

    def recv(self, buf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._peer(peer)
        self.nccl.pending("recv", buf, count)

    def bcast(self, buf: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._peer(root)  # one rank: the root's buffer is the result

    def destroy(self) -> None:
        pass


class LoopbackNccl:
    """The ``cupy.cuda.nccl`` functions the group uses: group calls (nested), the uint8 datatype."""

    NCCL_UINT8 = 7  # NCCL's ncclUint8

    def __init__(self):
        self.depth, self.sends, self.recvs = 0, [], []

    def groupStart(self) -> None:  # CuPy's names
        self.depth += 1

    def groupEnd(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self._launch()

    def pending(self, op: str, ptr: int, count: int) -> None:
        if self.depth == 0:
            raise RuntimeError(f"a {op} to oneself outside a group never completes (NCCL waits for its pair)")
        (self.sends if op == "send" else self.recvs).append((ptr, count))

    def _launch(self) -> None:
        sends, recvs, self.sends, self.recvs = self.sends, self.recvs, [], []
        if len(sends) != len(recvs):
            raise RuntimeError(f"{len(sends)} sends and {len(recvs)} receives to oneself in one group")
        for (src, n), (dst, m) in zip(sends, recvs):
            if n != m:
                raise RuntimeError(f"a send of {n} bytes matched with a receive of {m}")
            ctypes.memmove(dst, src, n)


def loopback_group() -> NcclGroup:
    """An ``NcclGroup`` of rank 0 of 1 on the host, past its (GPU-only) communicator set-up."""
    g = NcclGroup.__new__(NcclGroup)
    g.rank, g.world_size, g.device = 0, 1, torch.device("cpu")
    g.nccl = LoopbackNccl()
    g.comm = LoopbackComm(g.nccl)
    g.use_streams(HostStreams())
    return g
