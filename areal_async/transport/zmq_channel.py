"""ZeroMQ tensor channels: the CPU path across hosts (payload in band, as ``protocols.tensors`` frames).

Trajectories: PUSH/PULL, one multipart message per ``send`` (header + one raw frame per tensor,
sent with ``copy=False`` from the tensors' own memory; ``decode_tensors`` validates and copies
them into tensors that own their memory on the receiving side).

Weights: the publisher packs the buckets in ``publish_begin`` and serves them from a ROUTER
socket in a background thread; each receiver connects a DEALER to the endpoint named in the
manifest, requests the buckets (a window of ``WINDOW`` in flight) and checks every one. Any
number of receivers may fetch, at any time until ``release(version)``; ``publish_end`` waits for
``expect_receivers`` complete fetches (0: returns at once). Buckets are packed up front rather
than pipelined with the wire because receivers fetch at their own pace, long after packing.

Authentication and encryption: CURVE with the run's keys on ``tcp://`` (``protocols.curve``), as
on the control plane. Size limits: a fetch accepts no frame larger than the manifest's biggest
bucket; the trajectory receiver none larger than ``max_message_bytes`` (libzmq drops the sender's
connection before allocating it), and it refuses a message whose header declares more in all, or
whose frames differ in size from the sizes its header declares, before it allocates any tensor.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

import torch
import zmq

from areal_async.transport import buckets as B
from areal_async.transport.base import TensorChannel, Tensors, TransportError, WeightChannel
from areal_async.transport.notify import Pipe, deadline_of
from protocols.messages import ProtocolError, decode, encode
from protocols.side import WeightFetch
from protocols.sockets import make_socket
from protocols.tensors import decode_tensors, encode_tensors

log = logging.getLogger("areal_async.transport.zmq")

_CANCEL_POLL_S = 0.1  # how often a waiting fetch checks whether its channel was closed
WINDOW = 4  # buckets requested ahead: keeps the pipe full without buffering the whole model


TENSOR_MESSAGE_MAX_BYTES = 1 << 30  # default bound of one inbound tensor message (and so of each frame)
_HEADER_ROOM = 1 << 20  # a bucket reply's header frame, beside the bucket itself


class ZmqTensorChannel(TensorChannel):
    """``max_message_bytes`` (receiver): a larger frame is dropped at the socket (``ZMQ_MAXMSGSIZE``), a
    header declaring more in all is refused (``ProtocolError``) before anything is allocated."""

    def __init__(self, *, role: str, endpoint: str, max_message_bytes: int = TENSOR_MESSAGE_MAX_BYTES):
        if not isinstance(max_message_bytes, int) or max_message_bytes < 1:
            raise ValueError(f"max_message_bytes={max_message_bytes!r}: expected a positive int")
        self.max_message_bytes = max_message_bytes
        self._pipe = Pipe(role, endpoint, max_bytes=max_message_bytes)
        self.endpoint = self._pipe.endpoint

    def send(self, key: str, tensors: Tensors, meta: Optional[dict] = None) -> None:
        self._pipe.sock.send_multipart(encode_tensors(key, meta or {}, tensors), copy=False)

    def recv(self, timeout_s: Optional[float] = None) -> tuple[str, dict, Tensors]:
        self._pipe.wait(deadline_of(timeout_s))
        return decode_tensors(self._pipe.sock.recv_multipart(copy=False), self.max_message_bytes)

    def close(self) -> None:
        self._pipe.close()


class ZmqWeightChannel(WeightChannel):
    """``role='publisher'`` binds ``endpoint`` (default: a free port on ``advertise_host``)."""

    def __init__(
        self,
        *,
        role: str,
        bucket_mb: float = 64.0,
        checksum: str = "sum64",
        endpoint: Optional[str] = None,
        advertise_host: str = "127.0.0.1",
        expect_receivers: int = 0,
        timeout_s: float = 120.0,
    ):
        if role not in ("publisher", "receiver"):
            raise ValueError(f"role={role!r}: expected 'publisher' or 'receiver'")
        if checksum not in B.CHECKSUMS:
            raise ValueError(f"checksum={checksum!r}: expected one of {B.CHECKSUMS}")
        self.role, self.algo, self.timeout_s = role, checksum, timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.expect_receivers = expect_receivers
        self._last: Optional[int] = None
        self._closing = threading.Event()  # set by close(): an in-flight receive() gives up at once
        self._server = None
        if role == "publisher":
            self._server = _BucketServer(endpoint or f"tcp://{advertise_host}:*", advertise_host)

    def publish_begin(self, version: int, state_dict: Tensors) -> dict:
        layout = B.plan(state_dict, self.bucket_bytes)
        bufs = [torch.empty(n, dtype=torch.uint8) for n in layout.bucket_sizes]
        values = [B.pack_sum(layout, state_dict, k, buf, self.algo) for k, buf in enumerate(bufs)]  # one pass
        values = None if self.algo == "none" else values
        self._server.add(version, bufs)
        self._last = version
        return B.manifest("zmq", version, layout, self.algo, values, {"endpoint": self._server.endpoint})

    def publish_end(self) -> None:
        if self._last is None:
            raise RuntimeError("publish_end() without publish_begin()")
        self._server.wait_fetches(self._last, self.expect_receivers, self.timeout_s)

    @property
    def publish_end_waits(self) -> bool:
        return self.expect_receivers > 0

    def receive(self, manifest: dict) -> Tensors:
        layout, m = B.parse_manifest(manifest, "zmq")
        endpoint = m["handle"].get("endpoint")
        if not isinstance(endpoint, str):
            raise B.ManifestError(f"zmq manifest handle {m['handle']!r}: expected {{'endpoint': str}}")
        bufs = _fetch(endpoint, m["version"], layout.bucket_sizes, self.timeout_s, self._closing)
        B.verify(bufs, m["checksum"]["algo"], m["checksum"]["values"], m["version"])
        return B.unflatten(layout, bufs)

    def release(self, version: int) -> None:
        if self._server:
            self._server.drop(version)

    def close(self) -> None:
        """Stop serving (publisher); make a receive() in flight in another thread raise at once
        (receiver), so a worker shutting down never waits out ``timeout_s`` for a gone publisher."""
        self._closing.set()
        if self._server:
            self._server.close()
            self._server = None


def _fetch(
    endpoint: str, version: int, sizes: list[int], timeout_s: float, cancel: Optional[threading.Event] = None
) -> list[torch.Tensor]:
    """Request buckets 0..n-1 (``WINDOW`` ahead) and return them in order, checked against ``sizes``."""
    # no reply may be larger than the biggest bucket the manifest declared
    bound = max(sizes, default=0) + _HEADER_ROOM
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, connect=endpoint, max_bytes=bound)
    try:
        out: list[torch.Tensor] = []
        asked = 0
        while len(out) < len(sizes):
            while asked < len(sizes) and asked - len(out) < WINDOW:
                sock.send(encode(WeightFetch(version=version, bucket=asked)))
                asked += 1
            out.append(_bucket_reply(sock, version, len(out), sizes, timeout_s, cancel))
        return out
    finally:
        sock.close()


def _bucket_reply(
    sock: zmq.Socket, version: int, k: int, sizes: list[int], timeout_s: float, cancel: Optional[threading.Event] = None
) -> torch.Tensor:
    deadline = time.monotonic() + timeout_s
    while not sock.poll(int(max(0.0, min(_CANCEL_POLL_S, deadline - time.monotonic())) * 1000)):
        if cancel is not None and cancel.is_set():
            raise TransportError(f"weights v{version}: fetch of bucket {k} cancelled: the channel was closed")
        if time.monotonic() >= deadline:
            raise TransportError(f"weights v{version}: bucket {k} did not arrive within {timeout_s}s")
    key, meta, tensors = decode_tensors(sock.recv_multipart(copy=False))
    if "error" in meta:
        raise TransportError(f"weights v{version}: publisher refused bucket {k}: {meta['error']}")
    buf = tensors.get("bucket")
    if key != f"w{version}/{k}" or buf is None or buf.dtype != torch.uint8 or buf.numel() != sizes[k]:
        got = None if buf is None else (buf.dtype, buf.numel())
        raise TransportError(f"weights v{version}: expected bucket {k} of {sizes[k]} bytes, got {key!r} {got}")
    return buf


class _BucketServer:
    """A ROUTER in a thread: answers ``weight_fetch`` requests with bucket frames (zero-copy)."""

    def __init__(self, endpoint: str, advertise_host: str):
        self._versions: dict[int, list[torch.Tensor]] = {}
        self._done: dict[tuple[int, bytes], int] = {}  # (version, peer) -> buckets served
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._sock = make_socket(zmq.Context.instance(), zmq.ROUTER, bind=endpoint)
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = bound.replace("0.0.0.0", advertise_host or socket.gethostname())
        self._thread = threading.Thread(target=self._serve, name="zmq-weight-server", daemon=True)
        self._thread.start()

    def add(self, version: int, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            self._versions[version] = bufs

    def drop(self, version: int) -> None:
        with self._lock:
            self._versions.pop(version, None)
            self._done = {k: v for k, v in self._done.items() if k[0] != version}

    def wait_fetches(self, version: int, n: int, timeout_s: float) -> None:
        """Block until ``n`` peers fetched every bucket of ``version``."""

        def complete() -> int:
            total = len(self._versions.get(version, []))
            return sum(1 for (v, _), c in self._done.items() if v == version and c >= total)

        with self._lock:
            if not self._lock.wait_for(lambda: complete() >= n, timeout_s):
                raise TransportError(f"weights v{version}: {complete()} of {n} receivers fetched within {timeout_s}s")

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                peer, raw = self._recv()
                if peer is None:
                    continue
                try:
                    self._reply(peer, raw)
                except Exception:  # one request's failure must not end the server: every fetcher would hang
                    log.exception("weight server: request from peer %r failed; serving on", peer)

    def _recv(self) -> tuple[Optional[bytes], bytes]:
        frames = self._sock.recv_multipart()
        return (frames[0], frames[1]) if len(frames) == 2 else (None, b"")

    def _reply(self, peer: bytes, raw: bytes) -> None:
        try:
            req = decode(raw, (WeightFetch,))
        except ProtocolError as e:  # a bad request is answered, never fatal for the server
            self._send(peer, encode_tensors("error", {"error": str(e)}, {}))
            return
        version, k = req.version, req.bucket
        with self._lock:
            bufs = self._versions.get(version)
            if bufs is None or not 0 <= k < len(bufs):
                frames = encode_tensors("error", {"error": f"version {version} bucket {k} is not published"}, {})
            else:
                frames = encode_tensors(f"w{version}/{k}", {}, {"bucket": bufs[k]})
                self._done[(version, peer)] = self._done.get((version, peer), 0) + 1
                self._lock.notify_all()
        self._send(peer, frames)

    def _send(self, peer: bytes, frames: list) -> None:
        """Reply to ``peer``; a peer gone since it asked (a fetcher that timed out, was refused a bucket or
        closed, with requests still queued here) is dropped: ROUTER_MANDATORY raises EHOSTUNREACH for it."""
        try:
            self._sock.send_multipart([peer] + frames, copy=False)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("weight server: peer %r left before its reply; dropped", peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
