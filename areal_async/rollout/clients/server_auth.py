"""The per-run key of the inference servers (``Authorization: Bearer KEY``), on both sides.

The supervisor makes one key per fleet (``supervisor/servers.py``, written by ``supervisor/rundir.py``) and
hands it, in the environment (``AREAL_SERVER_API_KEY``; never on a command line ``ps`` shows, except
SGLang's own ``--api-key``), to the servers it starts and to the rollout workers that call them;
``http_json.call`` sends it on every request. Attaching to servers someone else runs
(``sglang.addresses``): export their key in that variable.

``refusal`` is the CPU server's check, as sglang 0.5.23 decides it with only ``--api-key`` set
(``srt/utils/auth.py``, ``decide_request_auth``, vendored in ``tests/support/data``): OPTIONS and paths under
``/health``, ``/ready``, ``/metrics`` are open; every other request needs ``Bearer <key>`` (the scheme
case-insensitive, the key compared in constant time), else 401 ``{"error": "Unauthorized"}``.
vLLM checks its key (``VLLM_API_KEY``) only on paths under ``/v1`` (``serve/middleware/authenticate.py``), so
the vLLM servers the supervisor starts also load ``vllm_path/areal_vllm_auth.py``, which refuses every route
without the key (``/health`` and the dev-mode weight routes included; see ``servers/vllm_server.py``).
"""

from __future__ import annotations

import os
import secrets
from typing import Optional

API_KEY_ENV = "AREAL_SERVER_API_KEY"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # k8s probes and Prometheus, open in SGLang too
UNAUTHORIZED = {"error": "Unauthorized"}


def server_key() -> str:
    """This process's key for the servers ('' when none was given: requests go without one)."""
    return os.environ.get(API_KEY_ENV, "")


def new_server_key() -> str:
    return secrets.token_urlsafe(32)


def auth_headers() -> dict:
    key = server_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def refusal(method: str, path: str, authorization: Optional[str], api_key: str) -> Optional[int]:
    """The status to refuse this request with (401), or None to serve it; no key: serve everything."""
    if not api_key or method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return None
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token and secrets.compare_digest(token, api_key):
        return None
    return 401
