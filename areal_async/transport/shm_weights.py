"""Shared-memory weight channel: versions go into a few persistent, pre-faulted segments, reused,
and the receivers read and verify each bucket while the publisher is still writing the next.

Segment layout: a 64-byte header (magic, version, layout bytes, bucket count), a table of one
``(stamp, checksum)`` pair per bucket, then, from the next page, the buckets back to back.

Publisher: ``publish_begin(version, state_dict)`` takes a pooled segment that no unreleased version
holds and no receiver still reads (an exclusive ``flock`` on it succeeds at once), clears the
table, writes the header and returns the manifest at once; the buckets are then written in a
packer thread (inline for a small state), each checksummed in the same pass while its bytes are in
cache (``buckets.pack_sum``), its checksum written into the table and then its stamp (= version).
The exclusive lock is dropped when the last bucket is stamped. ``publish_end`` waits for that (and
raises the packer's error). A segment is created, pre-faulted (``MAP_POPULATE``), only when no
pooled one is free and big enough: after the first versions a publication writes into warm pages
(measured here: packing 247 MiB into fresh ``/dev/shm`` pages took ~12x a warm copy).
``release(version)`` marks the header released and hands the segment back to the pool (at most
``POOL`` segments are kept; beyond, the name is unlinked). ``prewarm(n)`` creates, in a background
thread, the segments the pool lacks to hold ``n`` versions of the last published size: a publisher
that keeps two versions while it writes a third calls ``prewarm(3)`` after its first version, and
its next two then write into pages made while it trained (each new segment otherwise costs its
publication a ``MAP_POPULATE`` of the whole state: ~0.75 s of a 1.1 s update at 0.68 GB here).

Receiver: ``receive(manifest)`` checks the header holds the manifest's version (else
``TransportError``: released or superseded), then, bucket by bucket, waits for its stamp and
verifies its checksum against the table: the checksum pass of bucket k runs while the publisher
packs bucket k+1 (on another core), so an update costs about the publisher's pack plus the last
bucket's verify, where it cost pack plus verify of everything. Once the publisher dropped its
exclusive lock the receiver takes a shared ``flock`` (its own file description, so several
versions may be held at once) and keeps it while any returned tensor lives (a ``weakref.finalize``
on the lease drops it), so the publisher never rewrites bytes a receiver still uses; the header is
checked once more under that lock. A receiver that finds the lock free while a stamp is missing
knows the publisher stopped writing (it exited, or failed) and refuses the version at once.
The table is read with ``pread`` (never through the mapping), the stamp after the bytes it
covers: on x86 (TSO) a visible stamp means visible bytes; elsewhere a torn read fails the checksum
and is read once more through a fresh mapping before it is refused.
Its mapping is private (copy-on-write) and kept across versions (no ``mmap`` call per version):
reads see what the publisher wrote, a write by this receiver stays its own. A page it wrote stays
its own in later versions of that segment too, so when a checksum differs through a kept mapping
the version is read again through a fresh one before it is refused.

Residency: a version's pages leave each process's page tables once that process is done with them
(``MADV_DONTNEED``; the bytes stay in ``/dev/shm``): the publisher's after the last bucket is
stamped; a receiver's after each bucket's checksum, after each part a loader copied out and released
(``Received.release``: ``TorchEngine.update_weights`` copies ~64 MiB at a time), and when the last
tensor of the version dies. Otherwise every pooled segment a
process ever touched counts in its RSS for the rest of the run (SmolLM2-135M in float32: 3 x 0.54
GB in the trainer and again in the rollout worker, beside the 1.6 GB the pool itself holds in
``/dev/shm``). The cost: the publisher maps the segment's pages back before it writes
(``MADV_POPULATE_WRITE``, one call: measured here 0.13 s for 0.54 GB, against 0.29 s of write
faults, in the packer thread), a receiver takes read faults (fault-around maps 16 pages each:
0.09 s for 0.54 GB, about what the kept mapping's read took).

Not covered: other hosts (use zmq/gloo/nccl), non-Linux systems (no ``/dev/shm``, no ``flock``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from areal_async.transport import buckets as B
from areal_async.transport.base import Tensors, TransportError, WeightChannel
from areal_async.transport.shm import QUANTUM, SHM_DIR, Segment, _path, _unlink_names, new_prefix

log = logging.getLogger(__name__)

HEAD = 64  # header at the start of a segment; the bucket table follows it
PAGE = 4096  # the buckets start on a page of their own: a receiver's write never copies the table's page
_HEADER = struct.Struct("<8sqqq")  # magic, version (RELEASED when none), layout bytes, bucket count
_ENTRY = struct.Struct("<qQ")  # per bucket: stamp (the version whose bytes it holds), checksum
MAGIC = b"arealw02"
RELEASED = -1
FAILED = -2  # the header's version when the publisher failed while writing (its error: publish_end's)
POOL = 4  # segments a publisher keeps for reuse
INLINE_BYTES = 4 << 20  # a smaller state is packed inside publish_begin (a thread hop would cost more)
LOCK_TIMEOUT_S = 30.0  # a receiver waits this long for the publisher to finish writing a segment
_POLL_S = 0.0002  # a receiver's poll of the stamps (a 64 MiB bucket packs in ~8 ms here)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (not in Python's mmap module): map every page, writable, in one call


def data_start(n_buckets: int) -> int:
    """Where the buckets start in a segment of ``n_buckets`` buckets."""
    return -(-(HEAD + _ENTRY.size * n_buckets) // PAGE) * PAGE


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

    def set_header(self, version: int, total: int, n_buckets: int) -> None:
        self.version = version
        self.seg.mm[: _HEADER.size] = _HEADER.pack(MAGIC, version, total, n_buckets)

    def clear_table(self, n_buckets: int) -> None:
        self.seg.mm[HEAD : HEAD + _ENTRY.size * n_buckets] = _ENTRY.pack(RELEASED, 0) * n_buckets

    def stamp(self, k: int, version: int, value: int) -> None:
        """Bucket ``k`` holds ``version``'s bytes: its checksum first, then the stamp that covers it."""
        at = HEAD + _ENTRY.size * k
        self.seg.mm[at + 8 : at + 16] = struct.pack("<Q", value)
        self.seg.mm[at : at + 8] = struct.pack("<q", version)

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
        self._spares: list[Future] = []  # segments prewarm is making (each a _Pooled), oldest first
        self._warmer: Optional[ThreadPoolExecutor] = None  # prewarm's thread
        self._last_size = 0  # bytes of the segment the last publication needed
        self._packer: Optional[ThreadPoolExecutor] = None  # one thread: versions are written in order
        self._pending: dict[int, Future] = {}  # version -> its packing, until publish_end or release
        self._maps: OrderedDict[str, Segment] = OrderedDict()  # receiver: kept private mappings, newest last
        self._finalizer = weakref.finalize(self, _unlink_names, self._prefix)

    # --- publisher ----------------------------------------------------------------------------

    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        t0 = time.perf_counter()
        layout_ = B.plan(state_dict, self.bucket_bytes)
        self.release(version)  # republishing a version replaces it
        t1 = time.perf_counter()
        n = len(layout_.bucket_sizes)
        self._last_size = data_start(n) + layout_.total
        slot = self._acquire(self._last_size)
        try:
            slot.set_header(RELEASED, layout_.total, n)  # a stale reader sees no version while the table changes
            slot.clear_table(n)
            slot.set_header(version, layout_.total, n)
        except BaseException:
            slot.unlock()
            raise
        times = {"plan_s": t1 - t0, "segment_s": time.perf_counter() - t1}
        if layout_.total < INLINE_BYTES and not self._pending:
            self._pack(slot, layout_, state_dict, version, times)
        else:
            if self._packer is None:
                self._packer = ThreadPoolExecutor(1, thread_name_prefix="shm-weights-pack")
            self._pending[version] = self._packer.submit(self._pack, slot, layout_, state_dict, version, times)
        handle = {"segment": slot.seg.name, "size": slot.seg.size}
        return B.manifest("shm", version, layout_, self.algo, None, handle)

    def _pack(self, slot: _Pooled, layout_: B.Layout, state_dict: Tensors, version: int, times: dict) -> None:
        """Write, checksum and stamp every bucket in order, then let readers lock the segment."""
        t0 = time.perf_counter()
        try:
            resident(slot.seg.mm, True)
            bufs = _buckets(torch.from_numpy(slot.seg.array(data_start(len(layout_.bucket_sizes)))), layout_)
            for k, buf in enumerate(bufs):
                slot.stamp(k, version, B.pack_sum(layout_, state_dict, k, buf, self.algo))
        except BaseException:
            slot.set_header(FAILED, layout_.total, len(layout_.bucket_sizes))  # readers are told, not served
            slot.version = RELEASED
            raise
        finally:
            resident(slot.seg.mm, False)
            slot.unlock()
        self.phases = {**times, "pack_checksum_s": time.perf_counter() - t0}

    def _acquire(self, size: int) -> _Pooled:
        """The smallest free pooled segment of at least ``size`` bytes nobody reads, locked; else a
        prewarmed one (waiting for it when it is still being made: less than making another); else a new one."""
        for slot in sorted(self._pool, key=lambda s: s.seg.size):
            if slot.version == RELEASED and slot.seg.size >= size and slot.try_exclusive():
                return slot
        while self._spares:
            slot = self._adopt(self._spares.pop(0))
            if slot is not None and slot.seg.size >= size and slot.try_exclusive():
                return slot
        while len(self._pool) >= POOL and self._evict():
            pass
        slot = _create(self._next_name(), size)
        slot.try_exclusive()  # nobody knows the name yet: succeeds
        self._pool.append(slot)
        return slot

    def _next_name(self) -> str:
        self._count += 1
        return f"{self._prefix}_w{self._count - 1}"

    def _adopt(self, spare: Future) -> Optional[_Pooled]:
        """A prewarmed segment into the pool (None when making it failed: the caller makes one
        itself, and raises that error where it costs a publication)."""
        try:
            slot = spare.result()
        except Exception as e:  # OSError mostly (/dev/shm full): the synchronous create raises it again
            log.warning("shm weights: a prewarmed segment could not be made (%s); making it on demand", e)
            return None
        while len(self._pool) >= POOL and self._evict():
            pass
        self._pool.append(slot)
        return slot

    def prewarm(self, versions: int) -> None:
        if self.role != "publisher" or not self._last_size:
            raise RuntimeError("prewarm() is for a publisher, after its first publication")
        if not isinstance(versions, int) or not 1 <= versions <= POOL:
            raise ValueError(f"versions={versions!r}: expected an int in [1, {POOL}] (the pool keeps {POOL})")
        have = sum(s.seg.size >= self._last_size for s in self._pool) + len(self._spares)
        if have >= versions:
            return
        if self._warmer is None:
            self._warmer = ThreadPoolExecutor(1, thread_name_prefix="shm-weights-prewarm")
        for _ in range(versions - have):
            self._spares.append(self._warmer.submit(_create, self._next_name(), self._last_size))

    def _evict(self) -> bool:
        """Unlink one free segment (receivers that map it keep their memory); False when none is free."""
        for slot in self._pool:
            if slot.version == RELEASED:
                self._pool.remove(slot)
                slot.drop()
                return True
        return False

    def publish_end(self) -> None:
        """Wait until every version begun is written and stamped; the packer's error is raised here."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.result()

    @property
    def publish_end_waits(self) -> bool:
        return False  # it waits for this process's packer, never for a receiver

    def release(self, version: int) -> None:
        future = self._pending.pop(version, None)
        if future is not None:
            future.exception()  # written (or failed) before it is released; the error is publish_end's to raise
        for slot in self._pool:
            if slot.version == version:
                slot.set_header(RELEASED, 0, 0)  # a receiver that has not locked it yet is told, not served
                slot.version = RELEASED
                if len(self._pool) > POOL:
                    self._pool.remove(slot)
                    slot.drop()

    def close(self) -> None:
        if self._packer is not None:
            self._packer.shutdown(wait=True)
            self._packer = None
        if self._warmer is not None:
            self._warmer.shutdown(wait=True)  # every spare made (or failed): none is left to unlink later
            self._warmer = None
        for spare in self._spares:
            if spare.exception() is None:
                spare.result().drop()
        self._spares = []
        self._pending = {}
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
        reader = _Reader(name, m["version"], layout_, m["checksum"]["algo"])
        try:
            reader.check_header()
            seg, lease, bufs = self._verified(reader, size)
            t1 = time.perf_counter()
            reader.lock()
            reader.check_header()  # under the shared lock: nothing can rewrite it any more
        except BaseException:
            reader.close()
            raise
        weakref.finalize(lease, _let_go, seg.mm, reader.fd)  # with the last tensor of this version
        t2 = time.perf_counter()
        out = Received(B.unflatten(layout_, bufs), _Pages(seg.mm, lease))
        self.phases = {
            "wait_s": reader.waited,
            "verify_s": reader.summing,
            "lock_s": t2 - t1,
            "unflatten_s": time.perf_counter() - t2,
            "receive_s": time.perf_counter() - t0,
        }
        return out

    def _verified(self, reader: "_Reader", size: int):
        """(segment, lease, bucket views) through the kept mapping, or a fresh one when a checksum differs there."""
        kept = self._maps.get(reader.name)
        if kept is not None:
            lease, bufs = _views(kept, reader.layout)
            try:
                reader.verify(bufs, _Pages(kept.mm, lease))
                return kept, lease, bufs
            except _Mismatch:
                del self._maps[reader.name]  # maybe a page this receiver wrote: read it again through a fresh map
        seg = Segment.open(reader.name, size, private=True)
        lease, bufs = _views(seg, reader.layout)
        reader.verify(bufs, _Pages(seg.mm, lease))
        self._keep(reader.name, seg)
        return seg, lease, bufs

    def _keep(self, name: str, seg: Segment) -> None:
        """Keep ``seg``'s mapping; forget those whose segment the publisher unlinked (a kept mapping
        would hold its memory) and the oldest beyond ``POOL + 1``."""
        self._maps[name] = seg
        for gone in [n for n in self._maps if not (SHM_DIR / n).exists()]:
            del self._maps[gone]
        while len(self._maps) > POOL + 1:
            self._maps.popitem(last=False)


def _create(name: str, size: int) -> _Pooled:
    """A new segment for ``size`` bytes, its pages made (``MAP_POPULATE``: /dev/shm's zeroed pages, the
    costly part) and then dropped from this process's page tables; not yet in a pool."""
    slot = _Pooled(Segment.create(name, -(-size // QUANTUM) * QUANTUM, populate=True))
    resident(slot.seg.mm, False)
    return slot


def resident(mm: mmap.mmap, on: bool) -> None:
    """Map every page of ``mm`` into this process, writable, in one call (``on``), or drop them from its
    page tables (the bytes stay in the file: a shared mapping's next touch maps them again, a private
    mapping's reads the file again). On a kernel without ``MADV_POPULATE_WRITE`` (< 5.14) the writes
    fault the pages in one by one instead."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE if on else mmap.MADV_DONTNEED)
    except OSError:
        if not on:
            raise


class _Pages:
    """Drops the pages under tensors that view a segment's mapping (``lease`` starts ``data_start`` bytes
    into it) from this process; the bytes stay in the file, and a later read maps them again."""

    def __init__(self, mm: mmap.mmap, lease):
        self.mm, self.lease = mm, lease
        self.base = lease.ctypes.data - (len(mm) - lease.nbytes)  # the mapping's first byte

    def release(self, tensors) -> None:
        for t in tensors:
            start = t.data_ptr() - self.base
            lo, hi = start // PAGE * PAGE, -(-(start + t.numel() * t.element_size()) // PAGE) * PAGE
            if 0 <= lo < hi <= len(self.mm):
                self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class Received(dict):
    """A received version: name -> tensor viewing the segment. ``release(tensors)`` drops the pages under
    tensors the caller has copied out (a loader that copies part by part then maps one part at a time: the
    rollout's engine, ``TorchEngine.update_weights``); reading a released tensor again maps its pages again."""

    def __init__(self, tensors: dict, pages: _Pages):
        super().__init__(tensors)
        self._pages = pages

    def release(self, tensors) -> None:
        self._pages.release(tensors)


def _let_go(mm: mmap.mmap, fd: int) -> None:
    """A receiver is done with a version: its pages leave this process, then its shared lock is dropped."""
    try:
        resident(mm, False)
    finally:
        os.close(fd)


class _Mismatch(TransportError):
    """A bucket whose bytes do not sum to the checksum the publisher wrote (through a kept mapping: maybe a
    page this receiver wrote, so it is read once more through a fresh one; a wait that timed out or a
    publisher that stopped is not retried)."""


class _Reader:
    """One receive of one version: the segment's fd, its stamps and the shared lock once free."""

    def __init__(self, name: str, version: int, layout_: B.Layout, algo: str):
        self.name, self.version, self.layout, self.algo = name, version, layout_, algo
        self.n = len(layout_.bucket_sizes)
        self.locked = False
        self.waited = self.summing = 0.0
        self.deadline = time.monotonic() + LOCK_TIMEOUT_S
        try:
            self.fd = os.open(_path(name), os.O_RDONLY)
        except FileNotFoundError:
            raise TransportError(
                f"weights v{version}: shared-memory segment {name!r} does not exist (released, or made on another host)"
            ) from None

    def close(self) -> None:
        os.close(self.fd)

    def check_header(self) -> None:
        magic, have, total, n = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
        if magic != MAGIC:
            raise TransportError(
                f"weights v{self.version}: segment {self.name!r} is not a weight segment (magic {magic!r})"
            )
        if have != self.version or total != self.layout.total or n != self.n:
            if have == FAILED:
                raise TransportError(
                    f"weights v{self.version}: segment {self.name!r}: its publisher failed while writing it"
                )
            held = "no version" if have == RELEASED else f"version {have}"
            raise TransportError(
                f"weights v{self.version}: segment {self.name!r} now holds {held}: "
                f"v{self.version} was released or superseded"
            )

    def entry(self, k: int) -> tuple[int, int]:
        return _ENTRY.unpack(os.pread(self.fd, _ENTRY.size, HEAD + _ENTRY.size * k))

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self.locked = True
        except BlockingIOError:
            pass
        return self.locked

    def lock(self) -> None:
        """The shared lock: the publisher holds its exclusive one only while it writes (a few ms more)."""
        while not self.try_lock():
            self._tick("stayed locked by its publisher")

    def _tick(self, what: str) -> None:
        if time.monotonic() >= self.deadline:
            raise TransportError(f"weights v{self.version}: segment {self.name!r} {what} for {LOCK_TIMEOUT_S}s")
        time.sleep(_POLL_S)

    def stamped(self, k: int) -> int:
        """Bucket ``k``'s checksum once its stamp says this version; refused if the publisher stopped."""
        t0 = time.perf_counter()
        while True:
            stamp, value = self.entry(k)
            if stamp == self.version:
                self.waited += time.perf_counter() - t0
                return value
            if self.locked or self.try_lock():  # the publisher is not writing: the stamp will never come
                stamp, value = self.entry(k)  # (it may have come just before the lock was dropped)
                if stamp == self.version:
                    continue
                self.check_header()
                raise TransportError(
                    f"weights v{self.version}: segment {self.name!r}: bucket {k} of {self.n} was never written "
                    "(its publisher stopped writing: it exited or failed)"
                )
            self._tick(f"bucket {k} was not written")

    def verify(self, bufs: list[torch.Tensor], pages: Optional["_Pages"] = None) -> None:
        """Each bucket's checksum, as soon as its stamp is there, against the one the publisher wrote; its
        pages then leave this process (``pages``), so a receive maps one bucket at a time."""
        for k, buf in enumerate(bufs):
            want = self.stamped(k)
            if self.algo == "none":
                continue
            t0 = time.perf_counter()
            got = B.checksum(buf, self.algo)
            self.summing += time.perf_counter() - t0
            try:
                B.compare([got], [want], self.algo, self.version, [buf.numel()], first=k)
            except TransportError as e:
                raise _Mismatch(str(e)) from None
            if pages is not None:
                pages.release([buf])


def _handle(h: dict, layout_: B.Layout) -> tuple[str, int]:
    need = data_start(len(layout_.bucket_sizes)) + layout_.total
    if set(h) != {"segment", "size"} or not isinstance(h["size"], int) or h["size"] < need:
        raise B.ManifestError(
            f"shm manifest handle {h!r}: expected {{'segment': name, 'size': at least {need}}} "
            f"for {len(layout_.bucket_sizes)} buckets"
        )
    _path(h["segment"])  # a bad name is refused before any file is opened
    return h["segment"], h["size"]


def _views(seg: Segment, layout_: B.Layout):
    lease = seg.array(data_start(len(layout_.bucket_sizes)))  # one array per receive: every view keeps it alive
    return lease, _buckets(torch.from_numpy(lease), layout_)


def _buckets(flat: torch.Tensor, layout_: B.Layout) -> list[torch.Tensor]:
    return [flat[o : o + n] for o, n in zip(layout_.bucket_offsets(), layout_.bucket_sizes)]


__all__ = ["HEAD", "POOL", "SHM_DIR", "Received", "ShmWeightChannel", "data_start"]
