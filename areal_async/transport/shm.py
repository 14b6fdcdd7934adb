"""Shared-memory channels: one host, the payload never crosses a socket (Linux ``/dev/shm``).

Trajectories (``ShmTensorChannel``): the sender copies the tensors into a *slab* (a ``/dev/shm``
file both processes map) - that copy is the only one - and pushes a small msgpack note (tensor
header, slab name, offsets) over ZeroMQ. The receiver maps the slab once, unlinks its name (so
nothing is left in ``/dev/shm`` if either side crashes later) and returns tensors that are views
of the slab: usable at once, no second copy. Slabs are pooled and reused, because mapping fresh
memory costs a page fault per 4 KiB page (measured here: a copy into fresh pages runs at ~1/3 of
a copy into warm ones). A slab becomes reusable when every tensor of its message is garbage: a
``weakref.finalize`` on the message's buffer writes FREE into the slab's 64-byte control block,
which the sender reads before reuse (one writer at a time: the sender writes BUSY only over
FREE, the receiver FREE only over BUSY). Past ``pool_mb`` of slabs the sender falls back to
one-shot slabs that are never reused.

Weights: ``shm_weights.py`` (a few persistent segments, reused across versions), on ``Segment``.

Not covered: other hosts (use zmq/gloo/nccl), non-Linux systems (no ``/dev/shm``), a receiver
that dies while holding slabs (its slabs stay BUSY until the sender closes).
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import secrets
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from areal_async.transport.base import TensorChannel, Tensors, TransportError
from areal_async.transport.frames import header_bytes, layout, np_view_as, parse_header, tensor_views
from areal_async.transport.notify import Pipe, deadline_of
from protocols.messages import ProtocolError
from protocols.side import ShmRetire, ShmTensors

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "areal_"
_NAME_RE = re.compile(r"areal_[A-Za-z0-9_.-]{1,200}")
CTRL = 64  # control block at the head of a slab: byte 0 state (FREE/BUSY), byte 1 receiver-mapped
FREE, BUSY = 0, 1
QUANTUM = 1 << 20  # slab sizes are rounded up to this, so similar messages share slabs


def new_prefix(run_id: Optional[str] = None) -> str:
    """Segment-name prefix unique to this run, process and channel."""
    rid = run_id or secrets.token_hex(4)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", rid):
        raise ValueError(f"run_id={rid!r}: expected 1-64 characters from [A-Za-z0-9_.-]")
    return f"{NAME_PREFIX}{rid}_{os.getpid()}_{secrets.token_hex(3)}"


def _path(name: str) -> Path:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise TransportError(f"shared-memory segment name {name!r}: expected 'areal_' + [A-Za-z0-9_.-]")
    if not SHM_DIR.is_dir():
        raise TransportError(f"{SHM_DIR} does not exist: the shm channel needs Linux POSIX shared memory")
    return SHM_DIR / name


class Segment:
    """One ``/dev/shm`` file mapped into this process."""

    def __init__(self, name: str, mm: mmap.mmap, size: int):
        self.name, self.mm, self.size = name, mm, size

    @classmethod
    def create(cls, name: str, size: int, populate: bool = False) -> "Segment":
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, size)

    @classmethod
    def open(cls, name: str, size: int, *, private: bool, populate: bool = False) -> "Segment":
        try:
            fd = os.open(_path(name), os.O_RDONLY if private else os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(
                f"shared-memory segment {name!r} does not exist (already released, or made on another host)"
            ) from None
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise TransportError(
                    f"shared-memory segment {name!r} is {have} bytes, expected {size}: truncated or mislabelled"
                )
            flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, size)

    def array(self, start: int = 0) -> np.ndarray:
        """A new uint8 array over ``[start, size)``; tensors made from it keep the mapping alive."""
        return np.frombuffer(self.mm, dtype=np.uint8, count=self.size - start, offset=start)

    def unlink(self) -> None:
        _path(self.name).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# trajectories
# --------------------------------------------------------------------------------------------


class _Slab:
    def __init__(self, seg: Segment, pooled: bool):
        self.seg, self.pooled = seg, pooled
        self.ctrl = seg.array()[:CTRL]
        self.capacity = seg.size - CTRL
        self.data: Optional[np.ndarray] = None  # the sender's view of the payload area, made on first use

    def is_free(self) -> bool:
        return self.seg.mm[0] == FREE  # mmap indexing: an int, ~5x cheaper than a numpy scalar

    def is_mapped(self) -> bool:
        return self.seg.mm[1] == 1

    def release(self) -> None:
        self.ctrl[0] = FREE


class _SlabPool:
    """The sender's slabs: reuse a FREE one that fits (best fit among those known free), else make one.

    Pooled slabs are either *idle* (known FREE, sorted by capacity) or *lent* (handed out; BUSY
    until the receiver drops the message, oldest first). Lent slabs are polled only when no idle
    one fits, or the best idle fit is over twice the need, and then all of them only if the
    oldest is free (a trainer drops messages about in arrival order) or ``1/SCAN_EVERY`` of them
    were lent since the last full poll (so out-of-order frees are found too): a batch of
    messages costs about one pass over the lent slabs, not one per message over every slab (at
    512 messages a batch that scan cost ~0.05 s of the sender's 0.2 s here)."""

    LOOSE = 2  # an idle slab over LOOSE x the need (+ a quantum) is a poor fit: look for a freed one first
    SCAN_EVERY = 8

    def __init__(self, prefix: str, cap_bytes: int):
        self.prefix, self.cap = prefix, cap_bytes
        self.slabs: list[_Slab] = []  # every pooled slab, in creation order
        self.pooled_bytes = 0
        self.idle: list[_Slab] = []  # known FREE, by capacity ascending (``caps`` alongside)
        self.caps: list[int] = []
        self.lent: list[_Slab] = []  # oldest first
        self.unpolled = 0  # slabs lent since the last full poll
        self.oneshots: list[_Slab] = []  # kept mapped only until the receiver has mapped them
        self.count = 0
        weakref.finalize(self, _unlink_names, self.prefix)

    def acquire(self, nbytes: int) -> _Slab:
        if self.oneshots:
            self.oneshots = [s for s in self.oneshots if not s.is_mapped()]
        i = bisect.bisect_left(self.caps, nbytes)
        if i == len(self.caps) or self.caps[i] > self.LOOSE * nbytes + QUANTUM:
            self._reclaim()
            i = bisect.bisect_left(self.caps, nbytes)
        if i < len(self.caps):
            del self.caps[i]
            slab = self.idle.pop(i)
        else:
            slab = self._create(nbytes)
        slab.ctrl[0] = BUSY
        if slab.pooled:
            self.lent.append(slab)
            self.unpolled += 1
        return slab

    def _reclaim(self) -> None:
        """Move the lent slabs the receiver has freed to the idle list (see the class docstring for when)."""
        if not self.lent or (not self.lent[0].is_free() and self.unpolled * self.SCAN_EVERY < len(self.lent)):
            return
        self.unpolled = 0
        lent = []
        for s in self.lent:
            if s.is_free():
                i = bisect.bisect_right(self.caps, s.capacity)
                self.caps.insert(i, s.capacity)
                self.idle.insert(i, s)
            else:
                lent.append(s)
        self.lent = lent

    def _create(self, nbytes: int) -> _Slab:
        size = -(-(CTRL + nbytes) // QUANTUM) * QUANTUM
        pooled = self.pooled_bytes + size <= self.cap
        seg = Segment.create(f"{self.prefix}_{self.count}", size, populate=pooled)  # pre-fault what we reuse
        self.count += 1
        slab = _Slab(seg, pooled)
        if pooled:
            self.slabs.append(slab)
            self.pooled_bytes += size
        else:
            self.oneshots.append(slab)
        return slab

    def close(self, grace_s: float) -> list[str]:
        """Give the receiver ``grace_s`` to map in-flight slabs, then unlink every name; pooled names."""
        pending = [s for s in self.slabs + self.oneshots if not s.is_mapped()]
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            time.sleep(0.01)
            pending = [s for s in pending if not s.is_mapped()]
        _unlink_names(self.prefix)
        names = [s.seg.name for s in self.slabs]
        self.slabs, self.idle, self.caps, self.lent, self.oneshots = [], [], [], [], []
        self.pooled_bytes = self.unpolled = 0
        return names


def _unlink_names(prefix: str) -> None:
    for p in SHM_DIR.glob(f"{prefix}_*"):
        p.unlink(missing_ok=True)


class ShmTensorChannel(TensorChannel):
    """``role='receiver'`` binds ``endpoint`` (trainer); senders connect to it."""

    def __init__(
        self,
        *,
        role: str,
        endpoint: str,
        pool_mb: float = 2048.0,
        run_id: Optional[str] = None,
        close_grace_s: float = 2.0,
    ):
        self._pipe = Pipe(role, endpoint)
        self.endpoint = self._pipe.endpoint
        self._grace = close_grace_s
        self._pool = _SlabPool(new_prefix(run_id), int(pool_mb * 2**20)) if role == "sender" else None
        self._maps: dict[str, _Slab] = {}

    def send(self, key: str, tensors: Tensors, meta: Optional[dict] = None) -> None:
        header = header_bytes(key, meta or {}, tensors)
        srcs = list(tensors.values())
        sizes = [t.numel() * t.element_size() for t in srcs]
        offsets, total = layout(sizes)
        slab = self._pool.acquire(total)
        try:
            if slab.data is None:
                slab.data = slab.seg.array(CTRL)
            _fill(slab.data, srcs, offsets, sizes)
            self._pipe.send_note(
                ShmTensors(
                    seg=slab.seg.name,
                    size=slab.seg.size,
                    pooled=slab.pooled,
                    offsets=offsets,
                    sizes=sizes,
                    header=header,
                )
            )
        except BaseException:
            slab.release()
            raise

    def recv(self, timeout_s: Optional[float] = None) -> tuple[str, dict, Tensors]:
        deadline = deadline_of(timeout_s)
        while True:
            self._pipe.wait(deadline)
            note = self._pipe.recv_note((ShmTensors, ShmRetire))
            if isinstance(note, ShmTensors):
                return self._open(note)
            for name in note.segs:  # a sender closed: forget its slabs (memory goes with the last view)
                self._maps.pop(name, None)

    def _open(self, note: ShmTensors) -> tuple[str, dict, Tensors]:
        slab = self._slab(note.seg, note.size, note.pooled)
        try:
            header = parse_header(note.header)
            lease = slab.seg.array(CTRL)  # one object per message: its death frees the slab
            views = tensor_views(header, lease, note.offsets, note.sizes)  # every view keeps ``lease`` alive
        except BaseException:
            slab.release()
            raise
        if slab.pooled:
            weakref.finalize(lease, slab.release)
        return header.key, header.meta, views

    def _slab(self, name: str, size: int, pooled: bool) -> _Slab:
        slab = self._maps.get(name)
        if slab is not None:
            if slab.seg.size != size:
                raise ProtocolError(f"shm note says slab {name!r} is {size} bytes; it was mapped with {slab.seg.size}")
            return slab
        if size <= CTRL:
            raise ProtocolError(f"shm note: slab size {size} is not above the {CTRL}-byte control block")
        slab = _Slab(Segment.open(name, size, private=False, populate=pooled), pooled)
        slab.ctrl[1] = 1  # tell the sender we hold a mapping, so the name can go
        slab.seg.unlink()
        if pooled:
            self._maps[name] = slab
        return slab

    def close(self) -> None:
        if self._pool is not None:
            names = self._pool.close(self._grace)
            if names:
                self._pipe.send_note(ShmRetire(segs=names))
            self._pool = None
        self._maps.clear()
        self._pipe.close()


def _fill(data: np.ndarray, srcs: list[torch.Tensor], offsets: list[int], sizes: list[int]) -> None:
    """Copy each tensor into its slice of the slab: the one memcpy of the path.

    The destinations are numpy-built views (``np_view_as``) and CPU sources go in one
    ``torch._foreach_copy_`` call, so the sender leaves and re-takes the GIL once per message
    rather than once per tensor (where another thread of the process runs Python, each re-take
    waits for it). ``copy_`` handles strides, and devices for a non-CPU source."""
    pairs = [(np_view_as(data, off, n, t.dtype, list(t.shape)), t) for t, off, n in zip(srcs, offsets, sizes) if n]
    if not pairs:
        return
    with torch.no_grad():
        if all(t.is_cpu for _, t in pairs):
            torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
        else:
            for d, t in pairs:
                d.copy_(t)
