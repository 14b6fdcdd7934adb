"""The CPU SGLang twin takes a request between two decode steps, as SGLang's scheduler does (it receives every
request before each batch it runs): a pause sent while a long generation runs lands after at most the step in
progress, not when the generation has ended. In process: the twin's state object and its engine thread over a
real TorchEngine of the tiny preset's model; each step is slowed to 20 ms (holding the server's lock, as a real
step does), so "after the step in progress" and "after the generation" are 20 ms and ~1 s apart."""

from __future__ import annotations

import threading
import time

import pytest

from areal_async.config import load_config
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.rollout.servers.sglang_server import CpuSGLangServer
from tests.support.sglang_fixtures import TINY

NEW_TOKENS, STEP_S = 48, 0.02


@pytest.fixture
def twin():
    cfg = load_config(TINY)
    tok = policy_tokenizer(cfg.model)
    # no eos (-1): the sample runs its whole length, so every pause below finds it running
    engine = TorchEngine(build_model(cfg.model, len(tok), 1), -1, seed=0, max_batch_groups=4)
    server = CpuSGLangServer(engine, lambda ids: "", model_path="")
    steps = []
    real_step = engine.step

    def slow_step():
        out = real_step()
        time.sleep(STEP_S)
        steps.append(time.monotonic())
        return out

    engine.step = slow_step
    server.thread.start()
    yield server, tok, steps
    server.stopping.set()
    server.thread.join(timeout=10)


def _pause(server, steps, mode: str) -> int:
    """Pause mid-generation; the steps that ended between the call and its return."""
    before = len(steps)
    server.pause({"mode": mode})
    return len(steps) - before


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_pause_lands_between_two_steps_of_a_running_generation(twin, mode):
    """At most the step in progress, and one more the engine may have begun just before the pause reached the
    lock, run between a pause's call and its return (before this fix: up to the rest of the generation, 2-6
    steps in two runs here); retract keeps the request, which runs on after the resume; abort answers it now."""
    server, tok, steps = twin
    prompt = [tok.bos_token_id, *tok.encode("1+2=", add_special_tokens=False)]
    body = {"rid": "long", "input_ids": prompt, "return_logprob": True}
    body["sampling_params"] = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0}
    answer = {}
    gen = threading.Thread(target=lambda: answer.update(server.generate(body)))
    gen.start()
    deadline = time.monotonic() + 30
    while len(steps) < 3:  # the prefill and two decode steps have run: the sample is mid-generation
        assert time.monotonic() < deadline, "the engine thread did not start generating"
        time.sleep(0.001)
    if mode == "abort":  # answered now with the tokens it has
        ran = _pause(server, steps, mode)
        gen.join(timeout=30)
        meta = answer["meta_info"]
        assert ran <= 2 and meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < NEW_TOKENS
        return
    ran = []
    for _ in range(4):  # pause, check nothing runs, resume, let two steps run, again
        ran.append(_pause(server, steps, mode))
        held = len(steps)
        time.sleep(5 * STEP_S)
        assert len(steps) == held and gen.is_alive()  # paused: no step, the request kept
        server.resume({})
        while len(steps) < held + 2 and gen.is_alive():
            time.sleep(0.001)
    assert max(ran) <= 2, f"steps run between a pause's call and its return: {ran} (the generation runs {NEW_TOKENS})"
    gen.join(timeout=30)
    meta = answer["meta_info"]  # ran on to its end, not aborted
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == NEW_TOKENS
