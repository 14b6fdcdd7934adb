"""The CPU SGLang twin reports its own load time in a weight update's answer (``twin_timing``), beside SGLang's
``success`` and ``message``: what benchmarks/common/backends.py reads as the server-side load. In process: the
twin's state object over a real TorchEngine of the tiny preset's model, a real safetensors file."""

from __future__ import annotations

import time

import pytest
import torch

from areal_async.config import load_config
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.servers.sglang_server import CpuSGLangServer
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.rollout.clients.weights_file import save_state_file
from tests.support.sglang_fixtures import TINY


@pytest.fixture
def twin():
    cfg = load_config(TINY)
    tok = policy_tokenizer(cfg.model)
    engine = TorchEngine(build_model(cfg.model, len(tok), 1), tok, seed=0, max_batch_groups=4)
    return CpuSGLangServer(engine, lambda ids: "", model_path=""), cfg, tok


def timed_update(server: CpuSGLangServer, path, version: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = server.update_from_disk({"model_path": str(path), "weight_version": version, "flush_cache": False})
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("mode, recomputes", [("retract", True), ("in_place", False)])
def test_the_answer_carries_the_twins_load_and_kv_recompute_time(twin, tmp_path, mode, recomputes):
    server, cfg, tok = twin
    save_state_file(build_model(cfg.model, len(tok), 2).state_dict(), tmp_path / "model.safetensors")
    prompt = [tok.bos_token_id, *tok.encode("1+2=", add_special_tokens=False)]
    server.engine.add_request(GenRequest("g", prompt, n=2, max_new_tokens=8))
    for _ in range(3):
        server.engine.step()  # two samples mid-generation: their KV caches hold the old weights
    server.pause({"mode": mode})
    out, wall = timed_update(server, tmp_path, "7")
    assert out["success"] is True and out["message"].startswith("Succeeded to update model weights.")
    timing = out["twin_timing"]
    assert set(timing) == {"load_s", "recompute_s"}
    assert 0 < timing["load_s"] and timing["load_s"] + timing["recompute_s"] <= wall
    assert (timing["recompute_s"] > 0) is recomputes  # in_place keeps the old KV cache: nothing recomputed
    assert server.model_info()["weight_version"] == "7"


def test_a_refused_update_has_no_timing(twin, tmp_path):
    server, cfg, tok = twin
    sd = build_model(cfg.model, len(tok), 2).state_dict()
    sd["model.norm.weight"] = torch.zeros(3)  # a wrong shape: refused at load, as SGLang does
    save_state_file(sd, tmp_path / "model.safetensors")
    out, _ = timed_update(server, tmp_path, "8")
    assert out["success"] is False and "twin_timing" not in out
    assert server.model_info()["weight_version"] == "default"
