"""The rendezvous store of a gloo/NCCL group, served by its rank 0 over the run's own sockets.

torch's ``TCPStore`` has no authentication and its server listens on every interface (``*:port``,
checked with ``ss -ltnp`` on torch 2.13 for a store created on 127.0.0.1): anyone who reaches the
port can join the group, read the weights or inject tensors. Here the store is a Python
``torch.distributed.Store`` (torch calls its methods from C++, ``ProcessGroupGloo`` and
``init_process_group(store=...)`` accept it) whose keys live in rank 0's ``StoreServer``, a
ZeroMQ ROUTER made by ``protocols.sockets.make_socket``:

- ``ipc://`` endpoint (``cluster.control=ipc``): a socket file in the run's 0700 socket directory,
  no TCP listener at all;
- ``tcp://host:port`` (``cluster.control=tcp``): bound on ``host`` (the node's address, never a
  wildcard), a CURVE server whose ZAP handler admits only the run's client keys
  (``protocols.curve``): a peer without ``RUN_DIR/keys`` never gets a request through.
  ``cluster.curve=false`` turns that off explicitly (plain TCP, still bound to the node's address).

A bare ``host:port`` means ``tcp://host:port``. Requests and replies are typed msgpack side
messages (``StoreRequest``, ``StoreReply``); ``get``/``wait`` are answered when their keys exist,
or with an error after the request's timeout. The gloo pairs themselves bind the address of
``gloo_host`` (see ``collective.GlooGroup``); NCCL's bootstrap binds ``NCCL_SOCKET_IFNAME``'s.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from typing import Optional

import torch.distributed as dist
import zmq

from protocols.messages import ProtocolError, decode, encode
from protocols.side import StoreReply, StoreRequest
from protocols.sockets import make_socket

POLL_MS = 100  # the server's loop checks for expired waits and for stop this often


def store_endpoint(address: str) -> str:
    """``tcp://``/``ipc://`` endpoints as they are; ``host:port`` -> ``tcp://host:port``."""
    address = str(address)
    if address.startswith(("tcp://", "ipc://")):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or host in ("*", "0.0.0.0", "::", "[::]"):
        raise ValueError(f"store={address!r}: expected 'tcp://host:port', 'ipc://path' or 'host:port' (no wildcard)")
    return f"tcp://{host}:{port}"


class StoreServer:
    """The keys of one group, served on ``endpoint`` by a thread until ``close()``."""

    def __init__(self, endpoint: str):
        self.data: dict[str, bytes] = {}
        self.waits: list[tuple[bytes, StoreRequest, float]] = []  # (peer, request, deadline)
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=endpoint, max_bytes=StoreRequest.MAX_BYTES)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="store-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(POLL_MS):
                frames = self.sock.recv_multipart()
                if len(frames) == 2:  # anything else cannot be answered; CURVE already admitted the peer
                    self._answer(frames[0], frames[1])
            self._expire(time.monotonic())
        self.sock.close(0)
        self.ctx.term()

    def _answer(self, peer: bytes, data: bytes) -> None:
        try:
            req = decode(data, (StoreRequest,))
        except ProtocolError as e:
            return self._send(peer, StoreReply(id=-1, error=f"bad store request: {e}"))
        if req.op in ("get", "wait"):
            self.waits.append((peer, req, time.monotonic() + req.timeout_ms / 1000))
            return self._settle()
        self._send(peer, self._apply(req))
        self._settle()

    def _apply(self, req: StoreRequest) -> StoreReply:
        key, data = (req.keys or [""])[0], self.data
        if req.op == "set":
            data[key] = req.value
        elif req.op == "add":
            try:
                data[key] = str(int(data.get(key, b"0")) + req.n).encode()
            except ValueError:
                return StoreReply(id=req.id, error=f"add on key {key!r}, whose value is not an integer")
            return StoreReply(id=req.id, n=int(data[key]))
        elif req.op == "check":
            return StoreReply(id=req.id, n=int(all(k in data for k in req.keys)))
        elif req.op == "compare_set":
            if data.get(key, b"") == req.expected and (key in data or not req.expected):
                data[key] = req.value
            return StoreReply(id=req.id, value=data.get(key, req.expected))
        elif req.op == "delete_key":
            return StoreReply(id=req.id, n=int(data.pop(key, None) is not None))
        elif req.op == "num_keys":
            return StoreReply(id=req.id, n=len(data))
        return StoreReply(id=req.id)

    def _settle(self) -> None:
        """Answer every waiting get/wait whose keys all exist now."""
        still = []
        for peer, req, deadline in self.waits:
            if all(k in self.data for k in req.keys):
                self._send(peer, StoreReply(id=req.id, value=self.data[req.keys[0]] if req.op == "get" else b""))
            else:
                still.append((peer, req, deadline))
        self.waits = still

    def _expire(self, now: float) -> None:
        for peer, req, _ in [w for w in self.waits if w[2] <= now]:
            missing = [k for k in req.keys if k not in self.data]
            self._send(peer, StoreReply(id=req.id, error=f"{req.op}: timed out waiting for keys {missing}"))
        self.waits = [w for w in self.waits if w[2] > now]

    def _send(self, peer: bytes, reply: StoreReply) -> None:
        try:
            self.sock.send_multipart([peer, encode(reply)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer left (ROUTER_MANDATORY) or is not reading: it times out on its side

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * POLL_MS / 1000 + 5)


class ZmqStore(dist.Store):
    """A group member's view of the keys at ``endpoint`` (every call a request and its reply)."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, grace_s: float = 5.0):
        super().__init__()
        self.endpoint, self.timeout_s, self.grace_s = endpoint, float(timeout_s), float(grace_s)
        self._ctx = zmq.Context()
        self._ids = itertools.count()
        self._local = threading.local()  # a socket per calling thread: a blocking get never holds up a set
        self._socks: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._sock  # noqa: B018 (the constructing thread's socket, made with this process's keys of now)

    @property
    def _sock(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = make_socket(self._ctx, zmq.DEALER, connect=self.endpoint, max_bytes=StoreReply.MAX_BYTES)
            with self._lock:
                self._socks.append(sock)
            self._local.sock = sock
        return sock

    def _call(self, op: str, keys: list[str], timeout_s: Optional[float] = None, **kw) -> StoreReply:
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        req = StoreRequest(id=next(self._ids), op=op, keys=list(keys), timeout_ms=int(wait_s * 1000), **kw)
        limit = wait_s + self.grace_s  # a timed-out wait is answered by the server itself, before this
        reply = self._exchange(req, time.monotonic() + limit)
        if reply is None:
            raise dist.DistStoreError(f"store {self.endpoint}: no answer to {op} {keys} in {limit:.1f} s")
        if reply.error:
            raise dist.DistStoreError(f"store {self.endpoint}: {reply.error}")
        return reply

    def _exchange(self, req: StoreRequest, deadline: float) -> Optional[StoreReply]:
        """Send ``req`` and read replies until its own (an older id answers a call that timed out
        here); None at ``deadline``, also when the request could not even be queued (no peer admitted)."""
        while not self._sock.poll(1, zmq.POLLOUT):  # a DEALER whose handshake failed cannot queue
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        self._sock.send(encode(req))
        while (left := deadline - time.monotonic()) > 0 and self._sock.poll(int(left * 1000) + 1):
            reply = decode(self._sock.recv(), (StoreReply,))
            if reply.id == req.id:
                return reply
        return None

    def set(self, key: str, value) -> None:
        self._call("set", [key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key]).value

    def add(self, key: str, value: int) -> int:
        return self._call("add", [key], n=int(value)).n

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys).n)

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self._call("wait", keys, timeout.total_seconds() if timeout is not None else None)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", [key], expected=_bytes(expected), value=_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key]).n)

    def num_keys(self) -> int:
        return self._call("num_keys", []).n

    def close(self) -> None:
        with self._lock:
            for sock in self._socks:
                sock.close(0)
            self._socks.clear()
        self._ctx.term()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


_SERVERS: dict[str, StoreServer] = {}
_CLIENTS: dict[str, ZmqStore] = {}
_LOCK = threading.Lock()


def group_store(address: str, rank: int, timeout_s: float) -> ZmqStore:
    """The store of the group at ``address`` (rank 0 serves it); one per address per process."""
    endpoint = store_endpoint(address)
    with _LOCK:
        if rank == 0 and endpoint not in _SERVERS:
            _SERVERS[endpoint] = StoreServer(endpoint)
        if endpoint not in _CLIENTS:
            _CLIENTS[endpoint] = ZmqStore(endpoint, timeout_s)
        return _CLIENTS[endpoint]


def gloo_host(address: str, source_host: Optional[str]) -> Optional[str]:
    """The address this process's gloo pairs bind: its node's (``source_host``), loopback for a group
    on one host (an ``ipc://`` or loopback store), else None (gloo's default: the host name's address)."""
    if source_host:
        return source_host
    endpoint = store_endpoint(address)
    if endpoint.startswith(("ipc://", "tcp://127.", "tcp://localhost:")):
        return "127.0.0.1"
    return None
