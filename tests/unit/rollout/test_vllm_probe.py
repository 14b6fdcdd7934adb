"""The vLLM probe holds a server to what its dtype can promise (item 3 of issue 36).

The server is a recorder answering ``/v1/completions`` with ``prompt_logprobs`` in vLLM 0.32's schema
(``CompletionResponseChoice.prompt_logprobs``: per position a dict keyed by token id of ``{logprob, rank,
decoded_token}``, the prompt token's and the rank-1 token's), computed the way vLLM computes them: the model in
the server's dtype, ``log_softmax`` in float32 of its logits (``v1/sample/sampler.py`` line 309). The reference
is the worker's own (``ProbeReference``: one float32 forward of the trainer's weights). The model is the built
tiny Llama with its output layer scaled by 30, so its logits reach ~20 as a real model's do (bfloat16 rounds a
logit relative to its size): bfloat16 then moves the probe's logprobs by ~0.15 at most, 0.05 on average, what
SmolLM2-135M measured (0.14 / 0.048; ``rollout/clients/vllm_client.py``).
"""

from __future__ import annotations

import pytest
import torch

from areal_async.app.workers.rollout_worker import ProbeReference
from areal_async.config import load_config
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.rollout.clients.remote import ServerDown
from areal_async.rollout.clients.vllm_client import VLLMClient, probe_tolerance

CFG = load_config("configs/tiny_arith.yaml")
TOK = policy_tokenizer(CFG.model)


def weights(seed: int) -> dict[str, torch.Tensor]:
    m = build_model(CFG.model, len(TOK), seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # logits of a real model's size
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


class Server(VLLMClient):
    """The client over a recorder that serves ``served`` weights in ``dtype`` (module docstring)."""

    def serve(self, served: dict, dtype: torch.dtype) -> "Server":
        self.model_on_server = build_model(CFG.model, len(TOK), 0)
        self.model_on_server.load_state_dict(served)
        self.model_on_server.to(dtype).eval()
        return self

    def _call(self, method, path, body=None, timeout_s=None):
        if path != "/v1/completions":
            return {}  # pause, reload, reset, resume: what they do is not what is tested here
        assert body["prompt_logprobs"] == 1 and body["prompt"] == self.probe_ids
        with torch.no_grad():
            logits = self.model_on_server(input_ids=torch.tensor([body["prompt"]])).logits[0]
        logp = logits.log_softmax(-1, dtype=torch.float32)  # vLLM's compute_logprobs
        plp = [None]
        for i, t in enumerate(body["prompt"][1:]):
            row = logp[i]
            top = int(row.argmax())
            entry = {str(top): {"logprob": float(row[top]), "rank": 1, "decoded_token": "x"}}
            rank = 1 + int((row > row[t]).sum())
            entry[str(t)] = {"logprob": float(row[t]), "rank": rank, "decoded_token": "y"}
            plp.append(entry)
        return {"choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": plp}]}


def client(tmp_path, dtype: str) -> Server:
    ref = ProbeReference(CFG, TOK)
    return Server("http://127.0.0.1:9", weights_dir=str(tmp_path), probe_ids=ref.ids, probe_expected=ref,
                  probe_atol=2e-3, probe_dtype=dtype)  # fmt: skip


def test_a_bfloat16_server_holding_the_trainers_weights_passes_the_probe(tmp_path):
    sd = weights(5)
    c = client(tmp_path, "bfloat16").serve(sd, torch.bfloat16)
    c.update_weights(1, sd)
    assert c.version == 1
    assert c.last_probe_err > 2e-3  # the float32 rule (main's, for every dtype) refused this correct server
    assert c.last_probe_mean < probe_tolerance("bfloat16", 2e-3)[1] == pytest.approx(0.25)


def test_a_bfloat16_server_holding_other_weights_fails_the_probe(tmp_path):
    c = client(tmp_path, "bfloat16").serve(weights(6), torch.bfloat16)
    with pytest.raises(ServerDown, match="probe after loading v1"):
        c.update_weights(1, weights(5))
    assert c.version == -1


def test_a_float32_server_is_held_to_float32(tmp_path):
    sd = weights(5)
    c = client(tmp_path, "float32").serve(sd, torch.float32)
    c.update_weights(1, sd)
    assert c.last_probe_err < 2e-3
    c = client(tmp_path, "float32").serve(sd, torch.bfloat16)  # a server that computes in bfloat16 after all
    with pytest.raises(ServerDown, match="by max"):
        c.update_weights(2, sd)


def test_the_tolerance_follows_the_dtype():
    assert probe_tolerance("float32", 2e-3) == ("max", 2e-3)
    assert probe_tolerance("bfloat16", 2e-3) == ("mean", 32 * 2**-7)  # bfloat16's machine epsilon 2^-7
    assert probe_tolerance("float16", 2e-3) == ("mean", 32 * 2**-10)
    with pytest.raises(ValueError, match="probe dtype 'int8'"):
        probe_tolerance("int8", 2e-3)
