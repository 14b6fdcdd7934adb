"""Shared-memory weight channel: versions go into a few persistent, pre-faulted segments, reused.

Publisher: ``publish_begin(version, state_dict)`` takes a pooled segment that no unreleased
version holds and no receiver still reads (an exclusive ``flock`` on it succeeds at once), writes
the 64-byte header (magic, version, layout bytes) and then the buckets after it, each checksummed
in the same pass while its bytes are in cache (``buckets.pack_sum``). A segment is created, and
pre-faulted (``MAP_POPULATE``), only when no pooled one is free and big enough: after the first
versions a publication writes into warm pages (measured here: packing 247 MiB into fresh
``/dev/shm`` pages took ~12x a warm copy, the page faults being the whole difference).
``publish_end`` has nothing left to do. ``release(version)`` marks the header released and hands
the segment back to the pool (at most ``POOL`` segments are kept; beyond, the name is unlinked).

Receiver: ``receive(manifest)`` takes a shared ``flock`` on the segment (its own file description,
so several versions may be held at once) and keeps it while any returned tensor lives (a
``weakref.finalize`` on the lease drops it), so the publisher never rewrites bytes a receiver
still uses; it then checks the header still holds the manifest's version (else ``TransportError``:
released or superseded, wait for the next manifest) and verifies every bucket's checksum. Its
mapping is private (copy-on-write) and kept across versions, because mapping the pages again
costs a fault per page: reads see what the publisher wrote, a write by this receiver stays its
own. A page it wrote stays its own in later versions of that segment too, so when a checksum
differs through a kept mapping the version is read again through a fresh one before it is
refused.

Not covered: other hosts (use zmq/gloo/nccl), non-Linux systems (no ``/dev/shm``, no ``flock``).
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from areal_async.transport import buckets as B
from areal_async.transport.base import Tensors, TransportError, WeightChannel
from areal_async.transport.shm import QUANTUM, SHM_DIR, Segment, _path, _unlink_names, new_prefix

HEAD = 64  # header at the start of a segment; the buckets follow, back to back
_HEADER = struct.Struct("<8sqq")  # magic, version (RELEASED when none), layout bytes
MAGIC = b"arealw01"
RELEASED = -1
POOL = 4  # segments a publisher keeps for reuse
LOCK_TIMEOUT_S = 30.0  # a receiver waits this long for the publisher to finish writing a segment
_LOCK_POLL_S = 0.002


class _Pooled:
    """A publisher's segment: its mapping, an fd for ``flock`` and the version it holds."""

    def __init__(self, seg: Segment):
        self.seg, self.version = seg, RELEASED
        self.fd = os.open(_path(seg.name), os.O_RDWR)

    def try_exclusive(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def set_header(self, version: int, total: int) -> None:
        self.version = version
        self.seg.mm[: _HEADER.size] = _HEADER.pack(MAGIC, version, total)

    def drop(self) -> None:
        self.seg.unlink()
        os.close(self.fd)


class ShmWeightChannel(WeightChannel):
    def __init__(self, *, role: str, bucket_mb: float = 64.0, checksum: str = "sum64", run_id: Optional[str] = None):
        if role not in ("publisher", "receiver"):
            raise ValueError(f"role={role!r}: expected 'publisher' or 'receiver'")
        if checksum not in B.CHECKSUMS:
            raise ValueError(f"checksum={checksum!r}: expected one of {B.CHECKSUMS}")
        self.role, self.algo = role, checksum
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.phases: dict[str, float] = {}
        self._prefix = new_prefix(run_id)
        self._count = 0
        self._pool: list[_Pooled] = []  # every segment this publisher keeps, free or holding a version
        self._maps: OrderedDict[str, Segment] = OrderedDict()  # receiver: kept private mappings, newest last
        self._finalizer = weakref.finalize(self, _unlink_names, self._prefix)

    # --- publisher ----------------------------------------------------------------------------

    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        t0 = time.perf_counter()
        layout_ = B.plan(state_dict, self.bucket_bytes)
        self.release(version)  # republishing a version replaces it
        t1 = time.perf_counter()
        slot = self._acquire(HEAD + layout_.total)
        t2 = time.perf_counter()
        try:
            slot.set_header(RELEASED, layout_.total)  # a stale reader sees no version while the bytes change
            bufs = _buckets(torch.from_numpy(slot.seg.array(HEAD)), layout_)
            values = [B.pack_sum(layout_, state_dict, k, buf, self.algo) for k, buf in enumerate(bufs)]
            slot.set_header(version, layout_.total)
        finally:
            slot.unlock()
        self.phases = {"plan_s": t1 - t0, "segment_s": t2 - t1, "pack_checksum_s": time.perf_counter() - t2}
        handle = {"segment": slot.seg.name, "size": slot.seg.size}
        return B.manifest("shm", version, layout_, self.algo, values if self.algo != "none" else None, handle)

    def _acquire(self, size: int) -> _Pooled:
        """The smallest free pooled segment of at least ``size`` bytes nobody reads, locked; else a new one."""
        for slot in sorted(self._pool, key=lambda s: s.seg.size):
            if slot.version == RELEASED and slot.seg.size >= size and slot.try_exclusive():
                return slot
        while len(self._pool) >= POOL and self._evict():
            pass
        seg = Segment.create(f"{self._prefix}_w{self._count}", -(-size // QUANTUM) * QUANTUM, populate=True)
        self._count += 1
        slot = _Pooled(seg)
        slot.try_exclusive()  # nobody knows the name yet: succeeds
        self._pool.append(slot)
        return slot

    def _evict(self) -> bool:
        """Unlink one free segment (receivers that map it keep their memory); False when none is free."""
        for slot in self._pool:
            if slot.version == RELEASED:
                self._pool.remove(slot)
                slot.drop()
                return True
        return False

    def publish_end(self) -> None:
        """Nothing moves after ``publish_begin``: the receivers map the segment themselves."""

    @property
    def publish_end_waits(self) -> bool:
        return False

    def release(self, version: int) -> None:
        for slot in self._pool:
            if slot.version == version:
                slot.set_header(RELEASED, 0)  # a receiver that has not locked it yet is told, not served
                slot.version = RELEASED
                if len(self._pool) > POOL:
                    self._pool.remove(slot)
                    slot.drop()

    def close(self) -> None:
        for slot in self._pool:
            slot.drop()
        self._pool = []
        self._maps.clear()
        self._finalizer()

    # --- receiver -----------------------------------------------------------------------------

    def receive(self, manifest: dict) -> Tensors:
        t0 = time.perf_counter()
        layout_, m = B.parse_manifest(manifest, "shm")
        name, size = _handle(m["handle"], layout_)
        fd = _lock_shared(name, m["version"])
        try:
            _check_header(fd, name, m["version"], layout_.total)
            t1 = time.perf_counter()
            lease, bufs = self._verified(name, size, layout_, m)
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(lease, os.close, fd)  # the lock goes with the last tensor of this version
        t2 = time.perf_counter()
        out = B.unflatten(layout_, bufs)
        self.phases = {"lock_s": t1 - t0, "verify_s": t2 - t1, "unflatten_s": time.perf_counter() - t2}
        return out

    def _verified(self, name: str, size: int, layout_: B.Layout, m: dict):
        """(lease, bucket views) through the kept mapping, or a fresh one when a checksum differs there."""
        kept = self._maps.get(name)
        if kept is not None:
            lease, bufs = _views(kept, layout_)
            try:
                B.verify(bufs, m["checksum"]["algo"], m["checksum"]["values"], m["version"])
                return lease, bufs
            except TransportError:
                del self._maps[name]  # maybe a page this receiver wrote: read it again through a fresh map
        seg = Segment.open(name, size, private=True)
        lease, bufs = _views(seg, layout_)
        B.verify(bufs, m["checksum"]["algo"], m["checksum"]["values"], m["version"])
        self._keep(name, seg)
        return lease, bufs

    def _keep(self, name: str, seg: Segment) -> None:
        """Keep ``seg``'s mapping; forget those whose segment the publisher unlinked (a kept mapping
        would hold its memory) and the oldest beyond ``POOL + 1``."""
        self._maps[name] = seg
        for gone in [n for n in self._maps if not (SHM_DIR / n).exists()]:
            del self._maps[gone]
        while len(self._maps) > POOL + 1:
            self._maps.popitem(last=False)


def _handle(h: dict, layout_: B.Layout) -> tuple[str, int]:
    need = HEAD + layout_.total
    if set(h) != {"segment", "size"} or not isinstance(h["size"], int) or h["size"] < need:
        raise B.ManifestError(
            f"shm manifest handle {h!r}: expected {{'segment': name, 'size': at least {need}}} "
            f"for {len(layout_.bucket_sizes)} buckets"
        )
    _path(h["segment"])  # a bad name is refused before any file is opened
    return h["segment"], h["size"]


def _lock_shared(name: str, version: int) -> int:
    """An fd of segment ``name`` holding a shared ``flock`` (waits out a publisher writing it)."""
    try:
        fd = os.open(_path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise TransportError(
            f"weights v{version}: shared-memory segment {name!r} does not exist (released, or made on another host)"
        ) from None
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise TransportError(
                    f"weights v{version}: segment {name!r} stayed locked by its publisher for {LOCK_TIMEOUT_S}s"
                ) from None
            time.sleep(_LOCK_POLL_S)


def _check_header(fd: int, name: str, version: int, total: int) -> None:
    magic, have, n = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if magic != MAGIC:
        raise TransportError(f"weights v{version}: segment {name!r} is not a weight segment (magic {magic!r})")
    if have != version or n != total:
        held = "no version" if have == RELEASED else f"version {have}"
        raise TransportError(
            f"weights v{version}: segment {name!r} now holds {held}: v{version} was released or superseded"
        )


def _views(seg: Segment, layout_: B.Layout):
    lease = seg.array(HEAD)  # one array per receive: every tensor view keeps it (and the lock) alive
    return lease, _buckets(torch.from_numpy(lease), layout_)


def _buckets(flat: torch.Tensor, layout_: B.Layout) -> list[torch.Tensor]:
    return [flat[o : o + n] for o, n in zip(layout_.bucket_offsets(), layout_.bucket_sizes)]


__all__ = ["HEAD", "POOL", "SHM_DIR", "ShmWeightChannel"]
