"""JSON over HTTP/1.1 with the standard library: one keep-alive connection per thread and server.

``call(base, "POST", "/generate", body, timeout_s)`` returns the decoded JSON (or text) of a 2xx
answer; a non-2xx answer raises ``HTTPStatusError`` carrying the status and body; a refused,
reset or timed-out connection raises ``ServerUnreachable``. Nothing is retried here: the
callers (the remote engine) decide what a failure means. Every request carries the run's server key
(``server_auth``: ``Authorization: Bearer``) when this process has one.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any, Optional
from urllib.parse import urlparse

from areal_async.rollout.clients.server_auth import auth_headers


class ServerUnreachable(ConnectionError):
    """The server refused, dropped or did not answer the connection in time."""


class HTTPStatusError(RuntimeError):
    def __init__(self, method: str, url: str, status: int, body: Any):
        super().__init__(f"{method} {url} answered {status}: {body!r}"[:2000])
        self.status, self.body = status, body


_local = threading.local()


def _conn(base: str, timeout_s: float) -> http.client.HTTPConnection:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    c = pool.get(base)
    if c is None:
        u = urlparse(base)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"server address {base!r}: expected 'http://host:port'")
        c = pool[base] = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    c.timeout = timeout_s
    if c.sock is not None:
        c.sock.settimeout(timeout_s)
    return c


def _drop(base: str) -> None:
    c = getattr(_local, "pool", {}).pop(base, None)
    if c is not None:
        c.close()


def call(base: str, method: str, path: str, body: Optional[dict] = None, timeout_s: float = 30.0) -> Any:
    """One request; see the module docstring for what it raises."""
    data = None if body is None else json.dumps(body).encode()
    headers = auth_headers() | ({"Content-Type": "application/json"} if data is not None else {})
    for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile is reopened once
        c = _conn(base, timeout_s)
        try:
            c.request(method, path, body=data, headers=headers)
            resp = c.getresponse()
            raw = resp.read()
            break
        except (http.client.RemoteDisconnected, BrokenPipeError) as e:
            _drop(base)
            if attempt:  # the first failure is most likely a kept-alive socket the server had closed
                raise ServerUnreachable(f"{method} {base}{path}: {e}") from None
        except (ConnectionError, socket.timeout, OSError, http.client.HTTPException) as e:
            _drop(base)
            raise ServerUnreachable(f"{method} {base}{path}: {e!r}") from None
    out = _decode(raw, resp.getheader("Content-Type", ""))
    if not 200 <= resp.status < 300:
        raise HTTPStatusError(method, base + path, resp.status, out)
    return out


def _decode(raw: bytes, ctype: str) -> Any:
    if not raw:
        return None
    if "json" in ctype:
        return json.loads(raw)
    return raw.decode(errors="replace")
