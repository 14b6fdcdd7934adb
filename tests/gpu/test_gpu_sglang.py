"""The SGLang client against a real SGLang server on a GPU (``-m gpu``; needs the ``gpu`` extra).

A small Qwen2 model is built locally (random init), saved with ``save_pretrained`` and served by
``python -m sglang.launch_server``; the same checks as the CPU-server tests then run against it:
every /generate answer decodes as the pinned release's ``GenerateResponse``; weights reach the
server over a process group (gloo on one GPU: NCCL refuses two ranks on one device; NCCL with
two GPUs) and from disk, each time with the ``weight_version`` asked for and logprobs matching a
recomputation under the new weights; an interrupted sample carries two versions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("zmq", reason="the project's modules need pyzmq (see scripts/gpu_check.sh)")

from areal_async.config import ModelConfig
from areal_async.models.tiny import build_model, save_policy
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import call
from areal_async.rollout.clients.remote import RemoteEngine
from areal_async.rollout.clients.sglang_client import SGLangClient
from protocols.sockets import free_tcp_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODEL = ModelConfig(
    arch="qwen2",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("sglang", reason="the gpu extra (pip install -e '.[gpu]') brings sglang")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tok = build_char_tokenizer()
    path = tmp_path_factory.mktemp("qwen2-tiny")
    save_policy(build_model(MODEL, len(tok), 0), tok, path)
    port = free_tcp_port("127.0.0.1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(path),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--mem-fraction-static",
            "0.2",
            "--disable-cuda-graph",
            "--random-seed",
            "0",
        ],
        env=dict(os.environ),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        SGLangClient(url, name="gpu-probe").wait_ready(600)
        yield url, tok, path
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@torch.no_grad()
def logprobs_under(model, prompt, out):
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + out])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


def run_all(engine):
    done = {}
    t = time.monotonic()
    while engine.has_work():
        assert time.monotonic() - t < 300
        for g in engine.step():
            done[g.group_id] = SimpleNamespace(
                samples=[
                    SimpleNamespace(
                        output_ids=torch.as_tensor(s.output_ids).tolist(),
                        logprobs=torch.as_tensor(s.logprobs).tolist(),
                        versions=torch.as_tensor(s.versions).tolist(),
                        finish_reason=s.finish_reason,
                    )
                    for s in g.samples()
                ]
            )
    return done


@needs
@pytest.mark.parametrize("sync", ["distributed", "disk"])
def test_weights_reach_a_real_sglang_server_with_their_version(served, sync, tmp_path):
    url, tok, _ = served
    client = SGLangClient(url, name=f"gpu-{sync}", weight_sync=sync, group_backend="gloo", disk_dir=str(tmp_path))
    engine = RemoteEngine([client])
    prompt = tok.encode("3+4=")
    for version, seed in ((10, 1), (11, 2)):
        model = build_model(MODEL, len(tok), seed).eval()
        engine.update_weights(version, model.state_dict())
        assert call(url, "GET", "/model_info")["weight_version"] == str(version)
        engine.add_request(GenRequest(f"g{sync}{version}", prompt, 2, 16))
        for s in run_all(engine)[f"g{sync}{version}"].samples:
            assert s.versions == [version] * len(s.output_ids)
            assert s.logprobs == pytest.approx(logprobs_under(model, prompt, s.output_ids), abs=2e-3)


@needs
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the two ranks on two GPUs")
def test_weights_over_nccl_from_a_second_gpu(served):
    url, tok, _ = served
    torch.cuda.set_device(1)
    client = SGLangClient(url, name="gpu-nccl", group_backend="nccl")
    engine = RemoteEngine([client])
    engine.update_weights(20, build_model(MODEL, len(tok), 3).state_dict())
    assert call(url, "GET", "/model_info")["weight_version"] == "20"


@needs
def test_an_interrupted_sample_on_sglang_carries_two_versions(served):
    url, tok, _ = served
    a, b = (build_model(MODEL, len(tok), s).eval() for s in (4, 5))
    engine = RemoteEngine([SGLangClient(url, name="gpu-int", group_backend="gloo")])
    prompt = tok.encode("12+30=")
    for attempt in range(5):
        engine.update_weights(30 + 2 * attempt, a.state_dict())
        engine.add_request(GenRequest(f"i{attempt}", prompt, 32, 200))
        engine.step()
        time.sleep(0.02 * (attempt + 1))
        engine.update_weights(31 + 2 * attempt, b.state_dict())
        mixed = [s for s in run_all(engine)[f"i{attempt}"].samples if len(set(s.versions)) == 2]
        if mixed:
            break
    assert mixed, "no sample was interrupted"
    for s in mixed:
        k = s.versions.index(31 + 2 * attempt)
        assert s.logprobs[k:] == pytest.approx(logprobs_under(b, prompt, s.output_ids)[k:], abs=2e-3)
