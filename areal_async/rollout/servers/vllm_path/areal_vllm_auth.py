"""``--middleware areal_vllm_auth.BearerEverywhere``: the run's key on every route of a vLLM server.

vllm 0.32.0 checks ``VLLM_API_KEY`` only on paths under ``/v1``, ``/v2``, ``/inference``, ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX`` and ``__call__``), so the
routes ``VLLM_SERVER_DEV_MODE=1`` opens (``/collective_rpc``, ``/pause``, ``/resume``,
``/reset_prefix_cache``) answered anyone who reached the port. vLLM adds each ``--middleware`` class as
``app.add_middleware(cls)`` with no arguments (``serve/middleware/register.py``, the loop over
``args.middleware``), so this class reads the key from ``VLLM_API_KEY`` itself, and refuses to start
without one (fail closed). Every request (HTTP and websocket, any method, ``/health`` and ``/metrics``
too: our clients send the key on every call, ``rollout/clients/http_json.py``) needs ``Authorization: Bearer KEY``
(scheme case-insensitive, the key compared in constant time), else 401 ``{"error": "Unauthorized"}``,
as vLLM's own middleware answers. Lifespan events pass.

Standard library only: it is imported by the vLLM environment, where this package is not installed;
``vllm_server.py`` puts this directory (and nothing else of the package) on its PYTHONPATH.
"""

from __future__ import annotations

import hmac
import json
import os

KEY_ENV = "VLLM_API_KEY"
REFUSAL = json.dumps({"error": "Unauthorized"}).encode()


def authorized(headers, key: bytes) -> bool:
    """Whether the ASGI ``headers`` (a list of (name, value) byte pairs) carry ``Bearer <key>``."""
    value = next((v for n, v in headers if n.lower() == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token, key)


class BearerEverywhere:
    """Pure ASGI middleware: refuse (401) every http/websocket request without the key."""

    def __init__(self, app, key: str | None = None) -> None:
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            raise RuntimeError(f"areal_vllm_auth: {KEY_ENV} is empty; refusing to serve without a key")
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or authorized(scope.get("headers", []), self.key):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # close before accepting: the client sees 403 at the handshake
            return await send({"type": "websocket.close", "code": 1008})
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(REFUSAL)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": head})
        await send({"type": "http.response.body", "body": REFUSAL})
