"""The HTTP plumbing both server clients share (SGLang, vLLM): one call that turns transport
failures and 5xx answers into ``ServerDown``, and the health wait."""

from __future__ import annotations

import time
from typing import Optional

from areal_async.rollout.clients.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.rollout.clients.remote import ServerClient, ServerDown


class HTTPServerClient(ServerClient):
    """A ``ServerClient`` over JSON HTTP; subclasses set ``address``, ``control_timeout_s``."""

    address: str
    control_timeout_s: float
    health_poll_s = 0.2  # seconds between health probes while waiting for the server

    def _call(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None):
        try:
            return call(self.address, method, path, body, timeout_s or self.control_timeout_s)
        except ServerUnreachable as e:
            raise ServerDown(str(e)) from None
        except HTTPStatusError as e:
            if e.status >= 500:
                raise ServerDown(str(e)) from None
            raise

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._call("GET", "/health", timeout_s=max(1.0, min(5.0, timeout_s)))
                return
            except (ServerDown, HTTPStatusError) as e:
                if time.monotonic() >= deadline:
                    raise ServerDown(f"{self.address} not healthy after {timeout_s}s: {e}") from None
            time.sleep(self.health_poll_s)
