"""The middleware that puts the run's key on every route of a vLLM server (``areal_vllm_auth``), driven as
a plain ASGI app (no vLLM here; the real server is checked in test_vllm_backend.py), and the launcher
wiring that makes vLLM load it: its directory on PYTHONPATH, importable without this package."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from areal_async.rollout.servers.vllm_path.areal_vllm_auth import BearerEverywhere

KEY = "k3y-of-this-run"


def drive(headers: list[tuple[bytes, bytes]], path: str = "/collective_rpc", kind: str = "http", method="POST"):
    """Run one request through the middleware; returns (messages sent, whether the inner app ran)."""
    sent, inner = [], []

    async def app(scope, receive, send):
        inner.append(scope["path"] if "path" in scope else scope["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": kind} if kind == "lifespan" else {"type": kind, "path": path, "method": method, "headers": headers}
    asyncio.run(BearerEverywhere(app, KEY)(scope, receive, send))
    return sent, inner


@pytest.mark.parametrize(
    "authorization",
    [None, b"Bearer wrong-key", b"Basic " + KEY.encode(), b"Bearer " + KEY.encode() + b" ", b"Bearer", KEY.encode()],
)
def test_a_request_without_the_exact_bearer_key_gets_401_and_never_reaches_vllm(authorization):
    headers = [(b"host", b"x")] + ([(b"authorization", authorization)] if authorization else [])
    sent, inner = drive(headers)
    assert inner == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
    assert json.loads(sent[1]["body"]) == {"error": "Unauthorized"}  # vLLM's own refusal body
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(sent[1]["body"])).encode()


@pytest.mark.parametrize("path", ["/health", "/metrics", "/pause", "/resume", "/reset_prefix_cache", "/v1/models"])
def test_every_route_is_guarded_the_dev_routes_and_health_included(path):
    assert drive([], path, method="GET")[0][0]["status"] == 401
    assert drive([], path, method="OPTIONS")[0][0]["status"] == 401  # vLLM's own lets OPTIONS through
    assert drive([(b"authorization", b"Bearer " + KEY.encode())], path, method="GET") == (
        [{"type": "http.response.start", "status": 200, "headers": []}],
        [path],
    )


def test_the_scheme_is_case_insensitive_the_header_name_too_and_lifespan_passes():
    for name, scheme in ((b"authorization", b"bearer "), (b"Authorization", b"BEARER ")):
        assert drive([(name, scheme + KEY.encode())])[1] == ["/collective_rpc"]
    assert drive([], kind="lifespan")[1] == ["lifespan"]


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted():
    sent, inner = drive([], "/v1/realtime", kind="websocket")
    assert (sent, inner) == ([{"type": "websocket.close", "code": 1008}], [])


def test_no_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty"):
        BearerEverywhere(None)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert BearerEverywhere(None).key == KEY.encode()  # as vLLM builds it: add_middleware(cls), no arguments


def test_a_keyed_server_loads_it_from_a_path_that_holds_only_it(tmp_path):
    """With the run's key the launcher passes --middleware and a PYTHONPATH from which the module imports in
    an interpreter that cannot see this package (-S: no site-packages); without a key neither."""
    from areal_async.config import from_dict
    from areal_async.rollout.clients.server_auth import API_KEY_ENV
    from areal_async.rollout.servers.vllm_server import AUTH_MIDDLEWARE, AUTH_PATH, vllm_argv, vllm_env

    cfg = from_dict({}, ["rollout.backend=vllm", "cluster.n_rollout_workers=1"])
    env = vllm_env(cfg, {API_KEY_ENV: KEY, "PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(":") == [str(AUTH_PATH), "/elsewhere"]
    assert sorted(p.name for p in AUTH_PATH.glob("*.py")) == ["__init__.py", "areal_vllm_auth.py"]
    argv = vllm_argv(cfg, tmp_path, "127.0.0.1", 1, 0, keyed=True)
    assert argv[argv.index("--middleware") + 1] == AUTH_MIDDLEWARE == "areal_vllm_auth.BearerEverywhere"
    assert "--middleware" not in vllm_argv(cfg, tmp_path, "127.0.0.1", 1, 0)
    assert "PYTHONPATH" not in vllm_env(cfg, {})
    code = "import areal_vllm_auth as m, sys; print(m.BearerEverywhere(None).key, 'areal_async' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": env["PYTHONPATH"], "VLLM_API_KEY": KEY},
        cwd=tmp_path,  # not the repository: nothing of this package on the path
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == [repr(KEY.encode()), "False"], out.stderr
