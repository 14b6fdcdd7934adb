"""The inference servers' per-run key: the CPU SGLang server's check decides as sglang 0.5.23's own
``decide_request_auth`` (the vendored ``srt/utils/auth.py``, loaded and called here), its HTTP side
refuses a client without the key over a real socket before reading the body, the client sends the key
from its environment, and a weight update declaring tensors the model does not have is refused
before anything is allocated."""

from __future__ import annotations

import http.client
import importlib.util
import json
import sys
import threading

import pytest

from areal_async.rollout.clients import http_json
from areal_async.rollout.clients.server_auth import API_KEY_ENV, refusal
from areal_async.rollout.servers.sglang_http import make_http_server
from areal_async.rollout.servers.sglang_server import _beyond_model
from tests.support.sglang_fixtures import VENDORED, pinned_sglang_file

KEY = "k3y-of-this-run"


@pytest.fixture(scope="module")
def sglang_auth(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang") / "auth.py"
    path.write_text(pinned_sglang_file("sglang/srt/utils/auth.py"))
    spec = importlib.util.spec_from_file_location("sglang_auth_pinned", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclass resolves its annotations through the module
    spec.loader.exec_module(mod)
    return mod


def test_the_check_decides_as_sglangs_own(sglang_auth):
    assert (VENDORED / "sglang/srt/utils/auth.py.txt").is_file()
    headers = [None, "", f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", "Bearer wrong", f"Basic {KEY}", "Bearer",
               f"Bearer{KEY}", f"Bearer  {KEY}", f"Bearer {KEY} "]  # fmt: skip
    paths = ["/generate", "/health", "/health_generate", "/ready", "/metrics", "/update_weights_from_disk",
             "/init_weights_update_group", "/model_info", "/v1/completions", "/healthz"]  # fmt: skip
    n = 0
    for key in (KEY, None):
        for level in (sglang_auth.AuthLevel.NORMAL, sglang_auth.AuthLevel.ADMIN_OPTIONAL):
            for method in ("GET", "POST", "OPTIONS"):
                for path in paths:
                    for h in headers:
                        real = sglang_auth.decide_request_auth(
                            method=method, path=path, authorization_header=h, api_key=key, admin_api_key=None,
                            auth_level=level,
                        )  # fmt: skip
                        ours = refusal(method, path, h, key or "")
                        assert (ours is None) == real.allowed, (key, level, method, path, h)
                        assert ours in (None, real.error_status_code)
                        n += 1
    assert n == 2 * 2 * 3 * len(paths) * len(headers)


class _State:
    """What the HTTP side reads of the server for these routes (the auth check reads only api_key)."""

    api_key = KEY
    calls: list = []

    def model_info(self) -> dict:
        self.calls.append("model_info")
        return {"weight_version": "default"}

    def init_group(self, body: dict) -> dict:
        self.calls.append(("init_group", body))
        return {"success": True, "message": "joined"}


@pytest.fixture
def server():
    srv = make_http_server(_State(), "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    _State.calls = []
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _raw(port: int, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int, bytes, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request(method, path, body=body or None, headers=headers)
    r = c.getresponse()
    out = (r.status, r.read(), r.getheader("Connection", ""))
    c.close()
    return out


def test_a_client_without_the_key_is_refused_before_anything_runs(server, monkeypatch):
    base, port = server
    join = json.dumps({"master_address": "10.9.9.9", "master_port": 1, "rank_offset": 1, "world_size": 2}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, body, conn = _raw(port, "POST", "/init_weights_update_group", headers, join)
        assert (status, json.loads(body), conn) == (401, {"error": "Unauthorized"}, "close")
        assert _raw(port, "GET", "/model_info", headers)[0] == 401
    # a body it would have to allocate is never read: the answer comes before it is sent
    status, body, _ = _raw(port, "POST", "/generate", {"Content-Length": str(1 << 40)})
    assert status == 401
    assert _raw(port, "GET", "/health", {})[0] == 200  # probes stay open, as in SGLang
    assert _State.calls == []  # nothing reached the server's state
    # the run's client: the key from its environment, on every call
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert http_json.call(base, "GET", "/model_info") == {"weight_version": "default"}
    assert http_json.call(base, "POST", "/init_weights_update_group", json.loads(join))["success"] is True
    monkeypatch.setenv(API_KEY_ENV, "another-runs-key")
    with pytest.raises(http_json.HTTPStatusError) as e:
        http_json.call(base, "GET", "/model_info")
    assert e.value.status == 401
    assert _State.calls == ["model_info", ("init_group", json.loads(join))]


def test_a_declared_update_beyond_the_models_size_is_refused_before_allocating():
    from areal_async.config import from_dict
    from areal_async.models.tiny import build_model

    model = build_model(from_dict({}, []).model, 40, 0)
    sd = model.state_dict()
    names, shapes = list(sd), [list(p.shape) for p in sd.values()]
    biggest = max(p.numel() for p in sd.values())
    assert _beyond_model(model, names, ["float32"] * len(names), shapes) is None  # the model itself
    assert _beyond_model(model, names, ["bfloat16"] * len(names), shapes) is None
    assert _beyond_model(model, ["any.name"], ["float32"], [[3, 3]]) is None  # small: received, refused at load
    assert "more than the model's largest" in _beyond_model(model, [names[0]], ["float32"], [[biggest + 1]])
    assert "more than the model's largest" in _beyond_model(model, ["x"], ["float32"], [[1 << 20, 1 << 20]])
    twice = _beyond_model(model, names * 2, ["float32"] * 2 * len(names), shapes * 2)
    assert "more than the model's" in twice and "in all" in twice
    assert "floating-point" in _beyond_model(model, [names[0]], ["int64"], [shapes[0]])
    assert "floating-point" in _beyond_model(model, [names[0]], ["__class__"], [shapes[0]])
    assert "one length" in _beyond_model(model, names[:2], ["float32"], shapes[:2])


def test_the_supervisor_gives_each_fleet_a_fresh_key_for_the_servers_it_starts(tmp_path):
    """Ours and vLLM read it from the environment (never argv, which ps shows); SGLang takes --api-key;
    attaching to running servers makes no key (the caller's own AREAL_SERVER_API_KEY passes through)."""
    from areal_async.config import from_dict, load_config
    from areal_async.rollout.servers.vllm_server import vllm_env
    from areal_async.supervisor.servers import server_commands, server_key_env

    cpu = from_dict({}, ["rollout.backend=sglang", "cluster.n_rollout_workers=1"])
    env = server_key_env(cpu)
    key = env[API_KEY_ENV]
    assert len(key) >= 40 and server_key_env(cpu)[API_KEY_ENV] != key  # per fleet, 256 random bits
    assert all(key not in " ".join(c) for _, c in server_commands(cpu, tmp_path, ["http://127.0.0.1:1"], key))
    attach = ["rollout.backend=sglang", "cluster.n_rollout_workers=1", "sglang.addresses=['http://127.0.0.1:9']"]
    assert server_key_env(from_dict({}, attach)) == {}
    assert server_key_env(from_dict({}, [])) == {}  # the embedded engine: no servers
    gpu = load_config("configs/gsm8k_grpo.yaml", ["rollout.backend=sglang", "cluster.n_rollout_workers=1"])
    ((_, cmd),) = server_commands(gpu, tmp_path, ["http://127.0.0.1:1"], key)
    assert cmd[cmd.index("--api-key") + 1] == key and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    vllm = from_dict({}, ["rollout.backend=vllm", "cluster.n_rollout_workers=1"])
    assert vllm_env(vllm, {API_KEY_ENV: key})["VLLM_API_KEY"] == key
    assert "VLLM_API_KEY" not in vllm_env(vllm, {})
