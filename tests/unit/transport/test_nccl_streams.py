"""The order of NCCL stream operations in ``NcclGroup`` (item 10 of issue 23), checked without a GPU.

``torch.cuda``'s stream API is replaced by a recorder (``CudaStreams`` is the seam) and CuPy's communicator by
one that records its calls with CuPy's signatures (cupy/cuda/nccl.pyx: ``send/recv(intptr_t buf, size_t count,
int datatype, int peer, intptr_t stream)``, ``bcast(intptr_t buff, size_t count, int datatype, int root,
intptr_t stream)``: CuPy 14.2's embedded signatures). Expected: a receive (and a broadcast at a non-root rank)
is never ordered after the caller's stream, whose training kernels it would queue behind, and its buffer is
allocated on the group's stream; a send (and a broadcast from the root) waits for the caller's queued work
first, since its bytes come from it.
"""

from __future__ import annotations

import contextlib

import torch

from areal_async.transport.collective import CollectiveTensorChannel
from areal_async.transport.nccl import NcclGroup
from protocols.side import GroupTensors
from protocols.tensors import header_bytes


class Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.cuda_stream = name, log, 1000 + len(name)

    def wait_stream(self, other: "Stream") -> None:
        self.log.append(("wait", self.name, other.name))


class Event:
    def __init__(self, log: list):
        self.log = log

    def record(self, stream: Stream) -> None:
        self.log.append(("event", stream.name))

    def synchronize(self) -> None:
        self.log.append(("host waits",))


class Streams:
    """A recording stand-in for ``nccl.CudaStreams``: which stream is current, what waits for what."""

    def __init__(self):
        self.log: list = []
        self.caller = Stream("caller", self.log)
        self.on = [self.caller]

    def new(self, device):
        return Stream("nccl", self.log)

    def current(self, device):
        return self.on[-1]

    @contextlib.contextmanager
    def use(self, stream):
        self.on.append(stream)
        try:
            yield
        finally:
            self.on.pop()

    def event(self):
        return Event(self.log)

    def record(self, t, stream):
        self.log.append(("record", t.numel(), stream.name))


class Comm:
    def __init__(self, streams: Streams):
        self.streams = streams

    def _call(self, op, buf, count, datatype, peer, stream):
        assert isinstance(buf, int) and isinstance(count, int) and datatype == 7 and isinstance(stream, int)
        self.streams.log.append((op, count, peer, stream, self.streams.current(None).name))

    def send(self, *a):
        self._call("send", *a)

    def recv(self, *a):
        self._call("recv", *a)

    def bcast(self, *a):
        self._call("bcast", *a)


class Nccl:
    NCCL_UINT8 = 7

    def __init__(self, log):
        self.log = log

    def groupStart(self):  # CuPy's names
        self.log.append(("groupStart",))

    def groupEnd(self):
        self.log.append(("groupEnd",))


def group(rank: int = 0) -> tuple[NcclGroup, Streams]:
    """An ``NcclGroup`` past its (GPU-only) communicator set-up, on the recording streams."""
    g = NcclGroup.__new__(NcclGroup)
    streams = Streams()
    g.rank, g.world_size, g.device = rank, 2, torch.device("meta")
    g.nccl, g.comm = Nccl(streams.log), Comm(streams)
    g.use_streams(streams)
    return g, streams


def test_a_receive_is_not_ordered_after_the_callers_stream():
    g, s = group(rank=0)
    buf = g.recv_buffer(64)
    assert s.log == [("record", 64, "caller")]  # allocated on the group's stream, the caller's stream recorded
    s.log.clear()
    g.wait(g.recv([buf[:16], buf[16:]], src=1))
    assert s.log == [
        ("record", 16, "nccl"),
        ("record", 48, "nccl"),
        ("groupStart",),
        ("recv", 16, 1, 1004, "nccl"),
        ("recv", 48, 1, 1004, "nccl"),
        ("groupEnd",),
        ("event", "nccl"),
        ("host waits",),
    ]  # no ("wait", "nccl", "caller"): a training step queued on the caller's stream does not delay it


def test_a_send_waits_for_the_callers_queued_work_first():
    g, s = group(rank=1)
    g.send([torch.empty(8, device="meta")], dst=0)
    assert s.log[0] == ("wait", "nccl", "caller")
    assert s.log[1:] == [
        ("record", 8, "nccl"),
        ("groupStart",),
        ("send", 8, 0, 1004, "nccl"),
        ("groupEnd",),
        ("event", "nccl"),
    ]


def test_a_broadcast_waits_for_the_caller_at_the_root_only():
    root, s0 = group(rank=0)
    root.broadcast(torch.empty(32, device="meta"), root=0)
    assert s0.log == [
        ("wait", "nccl", "caller"),
        ("record", 32, "nccl"),
        ("bcast", 32, 0, 1004, "nccl"),
        ("event", "nccl"),
    ]
    other, s1 = group(rank=1)
    other.broadcast(other.recv_buffer(32), root=0)
    assert ("wait", "nccl", "caller") not in s1.log and ("bcast", 32, 0, 1004, "nccl") in s1.log


def test_the_trajectory_channel_receives_into_a_receive_buffer():
    """The channel's receive path asks the group for a receive buffer (the group's stream), not ``alloc``."""
    g, s = group(rank=0)
    asked = []
    g.alloc = lambda n: asked.append(("alloc", n))
    real = g.recv_buffer
    g.recv_buffer = lambda n: asked.append(("recv_buffer", n)) or real(n)
    chan = CollectiveTensorChannel.__new__(CollectiveTensorChannel)
    chan.group, chan.max_message_bytes = g, 1 << 20

    class Pipe:
        def wait(self, deadline):
            pass

        def recv_note(self, kinds):
            return GroupTensors(src=1, sizes=[12], header=header_bytes("k", {}, {"x": torch.zeros(3)}))

    chan._pipe = Pipe()
    key, meta, got = chan.recv(timeout_s=1)
    assert asked == [("recv_buffer", 64)] and key == "k" and got["x"].shape == (3,)
    assert ("wait", "nccl", "caller") not in s.log
