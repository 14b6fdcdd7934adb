"""rollout.on_weights in the embedded engine (keep / finish; recompute is test_engine_torch's), the rollout
worker's drain, and abort_groups: each against HF's own forward, never against the engine's cache code.

keep's reference: the OLD model's HF forward over prompt + the tokens fed before the update, with HF's own
cache, then the NEW model's forward of the rest on top of that cache (PipelineRL's in-flight update: new
weights, old keys and values)."""

import threading
import time

import pytest
import torch

from areal_async.rollout.service import EngineThread
from areal_async.rollout.engines.torch_engine import TorchEngine
from protocols.messages import GenerateRequest
from tests.unit.rollout.test_engine_torch import PROMPTS, TOK, _model, _ref_logprobs, _req, _run


def _keep_ref_logprobs(old, new, prompt_ids, out_ids, k) -> torch.Tensor:
    """Logprobs of out_ids[k:] when out_ids[:k] were sampled under ``old`` and decoding went on under ``new``
    over the cache ``old`` computed for prompt + out_ids[:k-1] (out_ids[k-1] is fed after the update)."""
    ids = list(prompt_ids) + [int(t) for t in out_ids]
    p = len(prompt_ids)
    with torch.no_grad():
        past = old(torch.tensor([ids[: p + k - 1]]), use_cache=True).cache  # HF's own cache (transformers 5)
        logits = new(torch.tensor([ids[p + k - 1 : -1]]), cache=past, use_cache=True).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(ids[p + k :])[:, None]).squeeze(1)


@pytest.mark.parametrize("layout", [None, "heads"])
def test_keep_decodes_on_the_old_cache_with_the_new_weights(layout):
    old, new = _model(seed=0), _model(seed=1)
    engine = TorchEngine(_model(seed=0), TOK, seed=3, version=4, kv_layout=layout, on_weights="keep")
    reqs = [_req(f"g{i}", p, n=2, max_new_tokens=10) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = {o.group_id: o for _ in range(4) for o in engine.step()}  # 4 tokens each under version 4
    recomputed, recompute = [], engine._recompute
    engine._recompute = lambda cohort: (recomputed.append(cohort), recompute(cohort))[1]
    engine.update_weights(5, new.state_dict())
    assert recomputed == []  # nothing recomputed (counted, not timed: a 1 ms bound failed under load)
    outs.update(_run(engine))
    differs = 0
    for r in reqs:
        for s in outs[r.group_id].samples():
            n, k = len(s.output_ids), min(4, len(s.output_ids))
            assert s.versions.tolist() == [4] * k + [5] * (n - k)  # tokens after the update carry the new version
            torch.testing.assert_close(
                s.logprobs[:k], _ref_logprobs(old, r.prompt_ids, s.output_ids)[:k], atol=1e-4, rtol=0
            )
            if n > k:
                kept = _keep_ref_logprobs(old, new, r.prompt_ids, s.output_ids, k)
                torch.testing.assert_close(s.logprobs[k:], kept, atol=1e-4, rtol=0)
                recomputed = _ref_logprobs(new, r.prompt_ids, s.output_ids)[k:]  # what recompute would give
                differs += int((kept - recomputed).abs().max() > 1e-3)
    assert differs > 0  # the reference tells keep from recompute


def test_finish_holds_new_groups_until_the_running_ones_end_under_the_old_weights():
    new = _model(seed=1)
    engine = TorchEngine(_model(seed=0), TOK, seed=3, version=0, on_weights="finish")
    engine.add_request(_req("a", "7+5=", n=2, max_new_tokens=6))
    outs = {o.group_id: o for _ in range(2) for o in engine.step()}
    engine.hold_new(True)
    engine.add_request(_req("b", "12+30=", n=2, max_new_tokens=6))
    while engine.in_flight():
        outs.update({o.group_id: o for o in engine.step()})
    assert "a" in outs and "b" not in outs and engine.has_work()  # b queued, never started
    engine.update_weights(1, new.state_dict())
    engine.hold_new(False)
    outs.update(_run(engine))
    assert all(s.versions.tolist() == [0] * len(s.output_ids) for s in outs["a"].samples())
    for s in outs["b"].samples():  # all of b under the new weights, from its prefill on
        assert s.versions.tolist() == [1] * len(s.output_ids)
        torch.testing.assert_close(
            s.logprobs, _ref_logprobs(new, TOK.encode("12+30="), s.output_ids), atol=1e-4, rtol=0
        )


def test_abort_groups_drops_a_running_and_a_queued_group_and_counts_their_tokens():
    model = _model(seed=0)
    engine = TorchEngine(model, -1, seed=3, version=0, max_batch_groups=4)  # no eos: rows end by length only
    for gid, prompt in (("a", "7+5="), ("b", "what is 12+30? "), ("c", "1")):
        engine.add_request(_req(gid, prompt, n=3, max_new_tokens=12))
    for _ in range(5):  # prefill (1 token) + 4 decodes: 5 tokens in each of the 9 rows
        assert engine.step() == []
    engine.hold_new(True)
    engine.add_request(_req("d", "ab", n=2, max_new_tokens=4))  # queued, not started
    assert engine.abort_groups(["b", "d", "zz"]) == {"b": 15, "d": 0}
    engine.hold_new(False)
    outs = _run(engine)
    assert sorted(outs) == ["a", "c"] and engine.live_ids == set()
    for gid, prompt in (("a", "7+5="), ("c", "1")):  # the rows left are undisturbed by the removal
        for s in outs[gid].samples():
            assert len(s.output_ids) == 12
            torch.testing.assert_close(
                s.logprobs, _ref_logprobs(model, TOK.encode(prompt), s.output_ids), atol=1e-4, rtol=0
            )


def test_abort_groups_counts_samples_set_aside_before_the_abort():
    engine = TorchEngine(_model(seed=0), -1, seed=3, version=0)
    # sample lengths differ by group: its rows finish at 2 (set aside at the compaction) and it waits for none
    engine.add_request(_req("short", "7+5=", n=4, max_new_tokens=2))
    engine.add_request(_req("long", "1", n=4, max_new_tokens=20))
    outs = {o.group_id: o for _ in range(6) for o in engine.step()}
    assert "short" in outs  # ended and returned: not live any more
    assert engine.abort_groups(["short", "long"]) == {"long": 4 * 6}


def _thread(engine, got, loaded, stopped):
    t = EngineThread(
        engine, lambda gs, reqs: got.extend(gs or []), lambda v, tm: loaded.append((v, tm)), 8, stopped.append
    )
    t.start()
    return t


def _gen(gid, prompt, n=2, max_new=12, min_version=0):
    return GenerateRequest(
        gid,
        f"p-{gid}",
        [f"{gid}.{i}" for i in range(n)],
        TOK.encode(prompt),
        ["x"],
        min_version,
        max_new_tokens=max_new,
    )


def test_the_engine_thread_drains_then_loads_under_finish():
    engine = TorchEngine(_model(seed=0), -1, seed=3, version=0, on_weights="finish")
    got, loaded, stopped = [], [], []
    t = _thread(engine, got, loaded, stopped)
    try:
        t.submit(_gen("a", "7+5=", max_new=240))  # long enough to be running when the weights are offered
        deadline = time.monotonic() + 30
        while not engine.in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)
        t.offer_weights(1, _model(seed=1).state_dict(), {"received": time.time()})
        t.submit(_gen("b", "1", max_new=5, min_version=0))  # may start only after a's drain and the load
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        t.stopping.set()
        t.join(5)
    outs = {g.group_id: g for g in got}
    assert [s.versions.tolist() for s in outs["a"].samples()] == [[0] * 240] * 2  # finished under the old weights
    assert [s.versions.tolist() for s in outs["b"].samples()] == [[1] * 5] * 2
    ((version, times),) = loaded
    assert version == 1 and times["drain_s"] > 0 and times["load_start"] >= times["received"] + times["drain_s"] - 1e-3


def test_the_engine_thread_stops_aborted_groups_and_reports_their_tokens():
    engine = TorchEngine(_model(seed=0), -1, seed=3, version=0)
    got, loaded, stopped = [], [], []
    gate = threading.Event()
    t = _thread(engine, got, loaded, stopped)
    try:
        t.submit(_gen("a", "7+5=", max_new=200))
        t.submit(_gen("q", "1", max_new=5, min_version=3))  # waits for weights v3: never added to the engine
        deadline = time.monotonic() + 30
        while not engine.in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)
        t.abort(["a", "q"])
        while not stopped and time.monotonic() < deadline:
            gate.wait(0.01)
    finally:
        t.stopping.set()
        t.join(5)
    (counts,) = stopped
    assert list(counts) == ["a"] and 0 < counts["a"] < 2 * 200  # stopped mid-way; q had nothing
    assert got == [] and t.waiting == [] and t.requests == {}
