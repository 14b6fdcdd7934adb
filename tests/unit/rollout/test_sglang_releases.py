"""Which SGLang releases the client can drive (item 7 of issue 36), read from the release wheels.

sglang 0.5.20's ``srt/entrypoints/http_server.py`` has no ``/begin_weight_update`` / ``/end_weight_update``
routes; 0.5.21 adds them (line 1400) with the refusal of a distributed update outside a session
(``scheduler_components/weight_updater.py`` line 182), as 0.5.23 (the pinned schema, line 1458) has them. So the
``gpu`` extra must not admit 0.5.20, and a server that answers 404 to the begin (an attached older server)
ends the worker saying so, instead of being marked down and revived, 404 after 404, until the run fails.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from areal_async.rollout.clients.http_json import HTTPStatusError
from areal_async.rollout.clients.sglang_client import ServerTooOld, SGLangClient

ROOT = Path(__file__).resolve().parents[3]
FIRST_WITH_SESSIONS = (0, 5, 21)  # read from the wheels (module docstring)


def _floor(spec: str) -> tuple[int, ...]:
    m = re.search(r">=\s*([0-9.]+)", spec)
    assert m, spec
    return tuple(int(x) for x in m.group(1).split("."))


def test_the_gpu_extra_admits_no_sglang_without_the_weight_update_session():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [spec] = [d for d in extras["gpu-cu13"] if d.startswith("sglang")]
    assert _floor(spec) >= FIRST_WITH_SESSIONS, spec


class OldServer(SGLangClient):
    """The client over a recorder answering as sglang 0.5.20 does: FastAPI's 404 for a route it lacks."""

    def _call(self, method, path, body=None, timeout_s=None):
        self.seen.append(path)
        if path == "/server_info":
            return {"tp_size": 1}
        if path == "/begin_weight_update":
            raise HTTPStatusError(method, self.address + path, 404, {"detail": "Not Found"})
        raise AssertionError(f"{path} after a refused begin")

    def _init_group(self):
        self.group = object()  # the group is not what is tested here


def test_a_server_without_the_session_routes_ends_the_worker_with_the_reason():
    import torch

    c = OldServer("http://127.0.0.1:9", name="old")
    c.seen = []
    with pytest.raises(ServerTooOld, match="before 0.5.21 has no weight-update session"):
        c.update_weights(1, {"w": torch.zeros(2)})
    assert c.seen == ["/begin_weight_update"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_lora_client_refuses_a_pause_that_keeps_requests(mode, tmp_path):
    """Item 6 of issue 36: under retract/in_place the paused requests keep holding the previous adapter, whose
    /unload_lora_adapter then waits for them (sglang 0.5.23 tokenizer_control_mixin.py line 651) while the
    client, which resumes only after the unload, waits for the unload: the update hangs to its timeout."""
    from areal_async.models.lora import LoraSpec

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="SGLang binds a request to the adapter it started with"):
        SGLangClient("http://127.0.0.1:9", name="l", pause_mode=mode, lora=spec, disk_dir=str(tmp_path))
    SGLangClient("http://127.0.0.1:9", name="l", pause_mode="abort", lora=spec, disk_dir=str(tmp_path))
