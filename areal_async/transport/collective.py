"""Channels over a collective library: gloo here (CPU), NCCL in ``nccl.py`` (GPU), one code path.

Set-up (both): a transport group of ``world_size`` processes, rank 0 = the trainer, ranks
1..N = rollout workers, rendezvous through the store at ``store`` (``transport.store``: served
by rank 0 over the run's authenticated sockets, ``tcp://host:port`` or ``ipc://path``).
Constructing a channel is itself collective: it returns once every rank of its group has
constructed its own. The trajectory and the weight channel are
separate groups (``name``), so a broadcast never interleaves with point-to-point traffic.

Trajectories: the sender pushes a msgpack note (the ``protocols.tensors`` header plus the byte
size of each tensor and its own rank) over ZeroMQ to the receiver's ``endpoint``, then sends the
payload with the library's ``send``; the receiver reads the note (so ``recv`` can time out
cleanly and needs no any-source receive, which NCCL lacks), receives every payload into one
aligned buffer on its device, and only then checks the header: a mislabelled header raises
``ProtocolError`` after the bytes were drained, so the next message still lines up.

Weights: ``publish_begin`` only plans the buckets (the manifest carries the layout; checksums
travel in band, after the buckets). ``publish_end`` packs bucket k+1 while bucket k is being
broadcast (two buffers; ``pipeline=False`` packs and broadcasts strictly in turn, for the
benchmark); gloo's buckets go out over two groups in turn (``WEIGHT_LANES``: each has its own
connections and thread, so two buckets are on the wire at once). Receivers post every bucket's
broadcast into one flat buffer, checksum each as it
lands, then compare with the trailer. A receiver that rejects a manifest does not join the
broadcast, and the publisher then waits until the group timeout: manifests come from our own
publisher, so that is a bug to fix, not a condition to recover from.

Not covered: trainers with several ranks publishing shards (rank 0 publishes the full state
dict), elastic groups (a restarted worker needs a new group: build new channels).
"""

from __future__ import annotations

import datetime
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Optional

import numpy as np
import torch

from areal_async.transport import buckets as B
from areal_async.transport.base import TensorChannel, Tensors, WeightChannel
from areal_async.transport.frames import flat_bytes, header_bytes, layout, parse_header, tensor_views
from areal_async.transport.notify import Pipe, deadline_of
from protocols.messages import ProtocolError
from protocols.side import GroupTensors

WEIGHT_LANES = 2  # gloo groups a weight channel's bucket broadcasts alternate over: 247 MiB in 64 MiB slices,
# one group 2.76 GB/s, two 3.72 (one host, loopback, two processes; measured here)
MAX_MESSAGE_BYTES = 1 << 30  # default bound of one trajectory message (tensor_channel.max_message_mb)


class Group(ABC):
    """The few collective calls the channels use; handles are waited with ``wait``."""

    name: str = ""  # the manifest's channel name: "gloo" | "nccl"
    default_checksum: str = "sum64"
    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def send(self, bufs: list[torch.Tensor], dst: int) -> Any: ...

    @abstractmethod
    def recv(self, bufs: list[torch.Tensor], src: int) -> Any: ...

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, root: int) -> Any: ...

    @abstractmethod
    def wait(self, handle: Any) -> None:
        """Block until the operation is done and its buffers may be reused."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def recv_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer that ``recv`` (or a broadcast from another rank) writes into (NCCL: on its own stream)."""
        return self.alloc(nbytes)

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Tear the group down."""


def check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an int in [0, {world_size})")


def gloo_options(store: str, timeout_s: float):
    """Gloo's options with its pairs bound to ``gloo_host`` (loopback for a group on one host)."""
    import torch.distributed as dist

    from areal_async.transport.store import gloo_host  # pyzmq: imported where a group is built (notify.py)
    from protocols.sockets import source_host

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    host = gloo_host(store, source_host())
    gloo = dist.ProcessGroupGloo
    opts._devices = [gloo.create_device(hostname=host) if host else gloo.create_default_device()]
    return opts


class GlooGroup(Group):
    name = "gloo"
    device = torch.device("cpu")

    def __init__(self, *, rank: int, world_size: int, store: str, name: str, timeout_s: float = 300.0, lanes: int = 1):
        """``lanes``: gloo groups (each its own connections and thread) that broadcasts take in turn; every
        rank must pass the same number and broadcast the same buffers in the same order."""
        import torch.distributed as dist

        from areal_async.transport.store import group_store

        check_rank(rank, world_size)
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes={lanes!r}: expected an int >= 1")
        self.rank, self.world_size = rank, world_size
        base = group_store(store, rank, timeout_s)
        self.lanes = [
            dist.ProcessGroupGloo(
                dist.PrefixStore(f"areal/{name}" + (f"/lane{i}" if i else ""), base),
                rank,
                world_size,
                gloo_options(store, timeout_s),
            )
            for i in range(lanes)
        ]
        self.pg = self.lanes[0]
        self._turn = 0

    def send(self, bufs: list[torch.Tensor], dst: int) -> list:
        return [self.pg.send([b], dst, 0) for b in bufs]

    def recv(self, bufs: list[torch.Tensor], src: int) -> list:
        return [self.pg.recv([b], src, 0) for b in bufs]

    def broadcast(self, buf: torch.Tensor, root: int) -> list:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pg, self._turn = self.lanes[self._turn % len(self.lanes)], self._turn + 1
        return [pg.broadcast([buf], opts)]

    def wait(self, handle: list) -> None:
        for work in handle:
            work.wait()

    def close(self) -> None:
        self.pg, self.lanes = None, []


# --------------------------------------------------------------------------------------------
# trajectories
# --------------------------------------------------------------------------------------------


class CollectiveTensorChannel(TensorChannel):
    """Receiver: binds ``endpoint``; senders push notes there and send payload to rank ``dst``."""

    def __init__(
        self, group: Group, *, role: str, endpoint: str, dst: int = 0, max_message_bytes: int = MAX_MESSAGE_BYTES
    ):
        self.group = group
        self.max_message_bytes = max_message_bytes
        self._pipe = Pipe(role, endpoint)
        self.endpoint = self._pipe.endpoint
        check_rank(dst, group.world_size)
        self.dst = dst

    def send(self, key: str, tensors: Tensors, meta: Optional[dict] = None) -> None:
        header = header_bytes(key, meta or {}, tensors)
        payload = [flat_bytes(t.to(self.group.device)) for t in tensors.values()]
        sizes = [p.numel() for p in payload]
        self._pipe.send_note(GroupTensors(src=self.group.rank, sizes=sizes, header=header))
        self.group.wait(self.group.send([p for p in payload if p.numel()], self.dst))

    def recv(self, timeout_s: Optional[float] = None) -> tuple[str, dict, Tensors]:
        self._pipe.wait(deadline_of(timeout_s))
        note = self._pipe.recv_note((GroupTensors,))
        src, sizes = note.src, note.sizes
        if not 0 <= src < self.group.world_size or src == self.group.rank:
            raise ProtocolError(f"tensor note names source rank {src}, expected a peer in [0, {self.group.world_size})")
        offsets, total = layout(sizes)
        if total > self.max_message_bytes:  # refused before allocating (the sender's send is then never matched)
            raise ProtocolError(f"tensor note announces {total} bytes, more than the bound {self.max_message_bytes}")
        flat = self.group.recv_buffer(total)
        bufs = [flat[o : o + n] for o, n in zip(offsets, sizes) if n]
        self.group.wait(self.group.recv(bufs, src))
        header = parse_header(note.header)  # checked after draining: a bad one cannot desync the pair
        return header.key, header.meta, tensor_views(header, flat, offsets, sizes)

    def close(self) -> None:
        self._pipe.close()
        self.group.close()


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


class CollectiveWeightChannel(WeightChannel):
    """Rank ``root`` publishes; every other rank of the group receives every version."""

    def __init__(
        self,
        group: Group,
        *,
        role: str,
        bucket_mb: float = 64.0,
        checksum: Optional[str] = None,
        pipeline: bool = True,
        root: int = 0,
    ):
        want = "publisher" if group.rank == root else "receiver"
        if role != want:
            raise ValueError(
                f"role={role!r} at rank {group.rank}: rank {root} publishes, others receive; expected {want!r}"
            )
        self.group, self.root, self.pipeline = group, root, pipeline
        self.algo = checksum or group.default_checksum
        if self.algo not in B.CHECKSUMS:
            raise ValueError(f"checksum={self.algo!r}: expected one of {B.CHECKSUMS}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._pending: Optional[tuple[int, B.Layout, Tensors]] = None
        self._pack_bufs: list[torch.Tensor] = []  # the publisher's bucket buffers, kept warm across versions
        self._flats = BufferPool() if group.device.type == "cpu" else None  # the receiver's, on CPU
        self.phases: dict[str, float] = {}

    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        lay = B.plan(state_dict, self.bucket_bytes)
        self._pending = (version, lay, state_dict)
        handle = {"root": self.root, "world_size": self.group.world_size}
        return B.manifest(self.group.name, version, lay, self.algo, None, handle)

    def publish_end(self) -> None:
        if self._pending is None:
            raise RuntimeError("publish_end() without publish_begin()")
        version, lay, sd = self._pending
        self._pending = None
        values = self._send_buckets(lay, sd)
        trailer = torch.tensor([_signed(v) for v in values], dtype=torch.int64, device=self.group.device)
        self.group.wait(self.group.broadcast(trailer.view(torch.uint8), self.root))

    def _send_buckets(self, lay: B.Layout, sd: Tensors) -> list[int]:
        """Pack bucket k+1 into the spare buffer while bucket k is on the wire; checksums in the same pass."""
        nbuf = 2 if self.pipeline else 1
        bufs = self._buffers(nbuf, max(lay.bucket_sizes, default=0))
        inflight: deque = deque()
        values, pack_s, t0 = [], 0.0, time.perf_counter()
        for k, n in enumerate(lay.bucket_sizes):
            if len(inflight) == nbuf:
                self.group.wait(inflight.popleft())
            buf = bufs[k % nbuf][:n]
            t = time.perf_counter()
            values.append(B.pack_sum(lay, sd, k, buf, self.algo))
            pack_s += time.perf_counter() - t
            if n:
                inflight.append(self.group.broadcast(buf, self.root))
        for h in inflight:
            self.group.wait(h)
        self.phases = {"pack_checksum_s": pack_s, "send_s": time.perf_counter() - t0 - pack_s}
        return values

    def _buffers(self, n: int, size: int) -> list[torch.Tensor]:
        """``n`` bucket buffers of at least ``size`` bytes, the same ones every version (no page faults)."""
        if len(self._pack_bufs) < n or any(b.numel() < size for b in self._pack_bufs[:n]):
            self._pack_bufs = [self.group.alloc(size).zero_() for _ in range(n)]  # zero_: fault the pages in now
        return self._pack_bufs[:n]

    def receive(self, manifest: dict) -> Tensors:
        lay, m = B.parse_manifest(manifest, self.group.name)
        if m["handle"] != {"root": self.root, "world_size": self.group.world_size}:
            raise B.ManifestError(
                f"{self.group.name} manifest handle {m['handle']!r}: this group has root "
                f"{self.root} and world_size {self.group.world_size}"
            )
        algo = m["checksum"]["algo"]
        t0 = time.perf_counter()
        flat = self._flats.take(lay.total) if self._flats is not None else self.group.recv_buffer(lay.total)
        bufs = [flat[o : o + n] for o, n in zip(lay.bucket_offsets(), lay.bucket_sizes)]
        handles = [self.group.broadcast(b, self.root) if b.numel() else None for b in bufs]
        trailer = self.group.recv_buffer(8 * len(bufs))
        trailer_h = self.group.broadcast(trailer, self.root) if bufs else None
        got, wait_s, t1 = [], 0.0, time.perf_counter()
        for buf, h in zip(bufs, handles):  # checksum bucket k while k+1.. are still arriving
            if h is not None:
                t = time.perf_counter()
                self.group.wait(h)
                wait_s += time.perf_counter() - t
            got.append(B.checksum(buf, algo) if algo != "none" else 0)
        if trailer_h is not None:
            self.group.wait(trailer_h)
        if algo != "none":
            want = [v & ((1 << 64) - 1) for v in trailer.view(torch.int64).tolist()]
            B.compare(got, want, algo, m["version"], lay.bucket_sizes)
        t2 = time.perf_counter()
        self.phases = {"alloc_s": t1 - t0, "wire_wait_s": wait_s, "checksum_s": t2 - t1 - wait_s}
        return B.unflatten(lay, bufs)

    def close(self) -> None:
        self.group.close()


class BufferPool:
    """The receiver's flat CPU buffers, reused once every tensor handed out of one is gone.

    Each ``take`` returns a tensor over a fresh numpy view (the lease) of a pooled array; the
    tensors made from it keep the lease alive, and its finalizer marks the array free again. So
    a version's weights stay intact as long as anyone holds them, and the next version lands in
    warm pages (a fresh 247 MiB buffer costs a page fault per 4 KiB: ~1x a copy here)."""

    KEEP = 2  # arrays kept: the version being loaded and the one before, still held by a slow reader

    def __init__(self):
        self.free: list[np.ndarray] = []  # by size, ascending

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, a in enumerate(self.free) if a.size >= nbytes]  # by index: == on arrays is elementwise
        if fits:
            arr = self.free.pop(min(fits, key=lambda i: self.free[i].size))
        else:
            arr = np.empty(nbytes, dtype=np.uint8)  # its pages fault in once, as the first version lands
        lease = arr[:nbytes]
        weakref.finalize(lease, self._give_back, arr)
        return torch.from_numpy(lease)

    def _give_back(self, arr: np.ndarray) -> None:
        self.free.append(arr)
        self.free = sorted(self.free, key=lambda a: a.size)[-self.KEEP :]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# --------------------------------------------------------------------------------------------
# gloo
# --------------------------------------------------------------------------------------------


class GlooTensorChannel(CollectiveTensorChannel):
    def __init__(
        self,
        *,
        role: str,
        endpoint: str,
        rank: int,
        world_size: int,
        store: str,
        dst: int = 0,
        name: str = "trajectories",
        timeout_s: float = 300.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        group = GlooGroup(rank=rank, world_size=world_size, store=store, name=name, timeout_s=timeout_s)
        super().__init__(group, role=role, endpoint=endpoint, dst=dst, max_message_bytes=max_message_bytes)


class GlooWeightChannel(CollectiveWeightChannel):
    def __init__(
        self,
        *,
        role: str,
        rank: int,
        world_size: int,
        store: str,
        bucket_mb: float = 64.0,
        checksum: Optional[str] = None,
        pipeline: bool = True,
        name: str = "weights",
        timeout_s: float = 300.0,
        lanes: int = WEIGHT_LANES,
    ):
        group = GlooGroup(rank=rank, world_size=world_size, store=store, name=name, timeout_s=timeout_s, lanes=lanes)
        super().__init__(group, role=role, bucket_mb=bucket_mb, checksum=checksum, pipeline=pipeline)
