"""ZeroMQ CURVE on the run's TCP sockets, with a ZAP handler that admits only the run's client keys.

A run has one server key pair (every socket that binds a ``tcp://`` endpoint is a CURVE server
with it) and one or more client key pairs (every socket that connects to a ``tcp://`` endpoint
presents one). A CURVE server's handshake is checked by the ZAP handler of its ZeroMQ context
(``inproc://zeromq.zap.01``, one thread per context, started on the first server socket):
it answers 200 only for a client public key on the allow list, so a peer without the run's
keys never gets a frame to the application (libzmq drops the connection during the handshake).

``use_curve(keys)`` sets the process's keys (a worker does it when it loads its run directory);
``protocols.sockets.make_socket`` then applies them to every ``tcp://`` socket it makes.
``ipc://`` sockets are left alone: they are guarded by the 0700 socket directory.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import zmq
from zmq.utils import z85

log = logging.getLogger("areal_async.protocols.curve")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "areal"
CURVE_FRAME_OVERHEAD = 64  # a CURVE MESSAGE command wraps a frame in 8 + 8 + 1 + 16 bytes; ZMQ_MAXMSGSIZE sees those


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keys of one process: the server pair (secret only where this process
    binds) and its own client pair; ``allow`` maps each admitted client public key to a name."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: Optional[bytes] = None
    allow: dict = field(default_factory=dict)  # client public key (z85 bytes) -> name (str)


_KEYS: Optional[CurveKeys] = None
_ZAP: dict[int, "ZapHandler"] = {}  # context address -> its handler
_ZAP_LOCK = threading.Lock()


def new_key_pair() -> tuple[bytes, bytes]:
    """(public, secret), Z85-encoded 40-byte keys."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE (libsodium); cluster.control=tcp needs it")
    return zmq.curve_keypair()


def use_curve(keys: Optional[CurveKeys]) -> None:
    """Set (or with None, clear) the keys ``make_socket`` applies to ``tcp://`` sockets in this process."""
    global _KEYS
    _KEYS = keys
    with _ZAP_LOCK:
        for h in _ZAP.values():
            h.allow = dict(keys.allow) if keys else {}


def current_keys() -> Optional[CurveKeys]:
    return _KEYS


def secure(sock: zmq.Socket, ctx: zmq.Context, endpoint: str, server: bool) -> bool:
    """Make ``sock`` (before its bind/connect to ``endpoint``) a CURVE server or client, when this
    process has keys and the endpoint is TCP; True when it did."""
    keys = _KEYS
    if keys is None or not endpoint.startswith("tcp://"):
        return False
    if server:
        if keys.server_secret is None:
            raise RuntimeError(f"cannot bind {endpoint} with CURVE: this process has no server secret key")
        zap_handler(ctx, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    return True


def zap_handler(ctx: zmq.Context, keys: CurveKeys) -> "ZapHandler":
    """The ZAP handler of ``ctx`` (started on first use; one per context, as ZeroMQ requires)."""
    addr = ctx.underlying
    with _ZAP_LOCK:
        h = _ZAP.get(addr)
        if h is None or not h.is_alive():
            h = _ZAP[addr] = ZapHandler(ctx, dict(keys.allow))
        return h


class ZapHandler(threading.Thread):
    """Answers ZAP requests of one context: CURVE with an allowed client key -> 200, else 400."""

    def __init__(self, ctx: zmq.Context, allow: dict):
        super().__init__(name="zap-handler", daemon=True)
        self.allow = allow
        self.refused = 0
        self.admitted = 0
        self._halt = threading.Event()
        # bound here, before any server socket of the context can take a connection
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        log.info("CURVE on: ZAP handler admits %d client key(s) (%s)", len(allow), ", ".join(map(str, allow.values())))
        self.start()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self.answer(self._sock.recv_multipart()))
        except zmq.ZMQError as e:  # ETERM: the context is being terminated
            if e.errno != zmq.ETERM:
                log.error("ZAP handler stopped: %s", e)
        finally:
            self._sock.close(0)

    def answer(self, frames: list) -> list:
        """The reply to one ZAP request (RFC 27): version, request id, status, text, user id, metadata."""
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        creds = frames[6:]
        who = address.decode(errors="replace")
        if mechanism != b"CURVE" or len(creds) != 1:
            self.refused += 1
            log.warning(
                "refused a %s connection from %s: only CURVE with the run's keys is accepted",
                mechanism.decode(errors="replace") or "NULL",
                who,
            )
            return [version, request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(creds[0])
        name = self.allow.get(key)
        if name is None:
            self.refused += 1
            log.warning(
                "refused a CURVE connection from %s: client key %s is not one of the run's keys", who, key.decode()
            )
            return [version, request_id, b"400", b"unknown client key", b"", b""]
        self.admitted += 1
        log.info("admitted a CURVE connection from %s (client key of %s)", who, name)  # the peer address seen
        return [version, request_id, b"200", b"OK", str(name).encode(), b""]

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=1.0)


def zap_stats() -> dict:
    """{'admitted': n, 'refused': n} over this process's ZAP handlers (for tests and logs)."""
    with _ZAP_LOCK:
        hs = list(_ZAP.values())
    return {"admitted": sum(h.admitted for h in hs), "refused": sum(h.refused for h in hs)}


@atexit.register
def _stop_all() -> None:
    """Close every handler's socket so a context terminated at exit does not wait for it."""
    with _ZAP_LOCK:
        hs = list(_ZAP.values())
    for h in hs:
        h.stop()
