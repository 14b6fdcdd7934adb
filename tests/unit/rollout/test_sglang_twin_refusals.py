"""The CPU SGLang twin refuses, with 400 and the key's name, the sampling settings it does not run, rather than
run them differently from SGLang: a key SGLang knows that the twin does not run (``top_k``), ``n`` > 1, and
``ignore_eos`` true (SGLang runs past eos; the engine stops there). ``ignore_eos`` false is SGLang's default
and is taken. In process: the twin's state object and engine thread over a real TorchEngine of the tiny model."""

from __future__ import annotations

import pytest

from areal_async.config import load_config
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.rollout.clients.sglang_rules import BadRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.rollout.servers.sglang_server import CpuSGLangServer
from tests.support.sglang_fixtures import TINY


@pytest.fixture
def twin():
    cfg = load_config(TINY)
    tok = policy_tokenizer(cfg.model)
    engine = TorchEngine(build_model(cfg.model, len(tok), 1), tok, seed=0, max_batch_groups=4)
    server = CpuSGLangServer(engine, lambda ids: "", model_path="")
    server.thread.start()
    yield server, [tok.bos_token_id, *tok.encode("1+2=", add_special_tokens=False)]
    server.stopping.set()
    server.thread.join(timeout=10)


@pytest.mark.parametrize(
    "params, words",
    [
        ({"top_k": 5}, "sampling_params key 'top_k' is not supported by the CPU server"),
        ({"n": 2}, "sampling_params.n=2: the CPU server generates one sample per request"),
        ({"ignore_eos": True}, "sampling_params.ignore_eos=true is not supported by the CPU server"),
    ],
)
def test_a_setting_the_twin_does_not_run_is_refused_by_name(twin, params, words):
    server, prompt = twin
    with pytest.raises(BadRequest, match=words.replace(".", r"\.")):
        server.generate({"rid": "r", "input_ids": prompt, "sampling_params": {"max_new_tokens": 3, **params}})
    assert not server.engine.has_work() and not server.waiters  # nothing was queued


def test_ignore_eos_false_is_taken(twin):
    server, prompt = twin
    out = server.generate(
        {"rid": "r", "input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": False}}
    )
    assert 0 < out["meta_info"]["completion_tokens"] <= 3
