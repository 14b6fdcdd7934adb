"""The SGLang backend against real CPU servers (separate processes, real HTTP, real gloo groups).

Expected tokens and logprobs come from plain full-sequence forwards of an HF model in this
process (no KV cache, no engine code), so a wrong weight, a stale KV cache or a mislabelled
version shows up as a mismatch.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from areal_async.base.process import Unfixable
from areal_async.config import load_config, to_yaml
from areal_async.models.tiny import build_model
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import call
from areal_async.rollout.clients.remote import REFUSALS_TO_FAIL, RemoteEngine, ServerDown
from areal_async.rollout.clients.sglang_client import SGLangClient
from areal_async.models.tokenizer import load_tokenizer
from tests.support.sglang_fixtures import TINY, start_cpu_server, stop

pytestmark = pytest.mark.timeout(300)

CFG = load_config(TINY)
TOK = load_tokenizer(CFG.model.path)


def policy(seed: int):
    return build_model(CFG.model, len(TOK), seed).eval()


@pytest.fixture(scope="module")
def server():
    proc, url = start_cpu_server()
    yield url
    stop(proc)


def collect(batches, out: dict | None = None) -> dict:
    """group id -> its samples as plain lists, for the groups an engine step finished (added to ``out``)."""
    out = {} if out is None else out
    out.update((g.group_id, SimpleNamespace(samples=[plain(s) for s in g.samples()])) for g in batches)
    return out


def run_all(engine: RemoteEngine, deadline_s: float = 120.0, out: dict | None = None) -> dict:
    """group id -> its samples as plain lists, once every queued group finished; ``out``: groups finished before
    (e.g. by the step that dispatched them: a fast server may answer a short request within it)."""
    out, t = dict(out or {}), time.monotonic()
    while engine.has_work():
        assert time.monotonic() - t < deadline_s, "generation did not finish"
        collect(engine.step(), out)
    return out


def plain(s) -> SimpleNamespace:
    ids, logps, versions = (torch.as_tensor(x).tolist() for x in (s.output_ids, s.logprobs, s.versions))
    return SimpleNamespace(output_ids=ids, logprobs=logps, versions=versions, finish_reason=s.finish_reason)


@torch.no_grad()
def logprobs_under(model, prompt: list[int], out: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T)[token] of each output token, one full forward (independent of the engines)."""
    ids = torch.tensor([prompt + out])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


@torch.no_grad()
def greedy_under(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_weights_arrive_over_the_gloo_group_with_each_weight_version(server):
    a, b = policy(11), policy(12)
    client = SGLangClient(server, name="t-weights", bucket_mb=0.05)  # several buckets per update
    engine = RemoteEngine([client])
    prompt = TOK.encode("3+4=")
    for version, model in ((0, a), (1, b), (2, a)):
        engine.update_weights(version, model.state_dict())
        assert call(server, "GET", "/model_info")["weight_version"] == str(version)
        engine.add_request(GenRequest(f"g{version}", prompt, 1, 8, greedy=True))
        s = run_all(engine)[f"g{version}"].samples[0]
        assert s.output_ids == greedy_under(model, prompt, len(s.output_ids)) and s.versions == [version] * 8
        assert s.logprobs == pytest.approx(logprobs_under(model, prompt, s.output_ids), abs=1e-4)


def test_a_failed_update_fails_loudly_and_the_half_updated_server_serves_nothing(server):
    """The last bucket has a wrong shape: earlier buckets already loaded, so the server refuses
    /generate (503) until a complete update succeeds; the client raises ServerDown."""
    a, b = policy(51), policy(52)
    client = SGLangClient(server, name="t-fail", bucket_mb=0.05)
    client.wait_ready(120)
    client.update_weights(0, a.state_dict())
    bad = dict(b.state_dict())
    last = list(bad)[-1]
    bad[last] = torch.zeros(3, 3)
    with pytest.raises(ServerDown, match=f"{last}.*shape"):
        client.update_weights(1, bad)
    prompt = TOK.encode("1+1=")
    with pytest.raises(ServerDown, match="503.*weights unusable after a failed update"):
        client.generate("after-bad", prompt, 4, GenRequest("x", prompt, 1, 4, greedy=True))
    assert call(server, "GET", "/model_info")["weight_version"] == "0"
    client.update_weights(2, b.state_dict())
    c = client.generate("after-good", prompt, 4, GenRequest("x", prompt, 1, 4, greedy=True))
    assert c.versions == [2] * 4 and c.output_ids == greedy_under(b, prompt, 4)


ATTEMPTS = 9


def interrupt_delay(attempt: int) -> float:
    """Seconds between dispatch and the weight update: 2 ms doubling to ~0.5 s, so the update lands
    mid-generation on a quiet machine (48 tokens take tens of ms) and on a loaded one alike."""
    return 0.002 * 2**attempt


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_interrupted_samples_carry_two_versions_and_new_tokens_match_the_new_weights(server, mode):
    """Pause mid-generation, load v1, resume: a sample's first tokens carry v0 with v0's
    logprobs, the rest v1 with logprobs recomputed under v1 (abort: resubmitted prompt + tokens;
    retract: the server recomputed its KV cache)."""
    a, b = policy(21), policy(22)
    engine = RemoteEngine([SGLangClient(server, name=f"t-int-{mode}", pause_mode=mode)])
    prompt = TOK.encode("12+30=")
    mixed = []
    for attempt in range(ATTEMPTS):  # timing: the update must land while tokens are being generated
        engine.update_weights(2 * attempt, a.state_dict())
        engine.add_request(GenRequest(f"g{attempt}", prompt, 16, 48))
        first = collect(engine.step())  # dispatches every sample
        time.sleep(interrupt_delay(attempt))
        engine.update_weights(2 * attempt + 1, b.state_dict())
        groups = run_all(engine, out=first)
        mixed = [s for s in groups[f"g{attempt}"].samples if len(set(s.versions)) == 2]
        if mixed:
            break
    assert mixed, f"no sample was interrupted mid-generation in {ATTEMPTS} tries"
    old, new = 2 * attempt, 2 * attempt + 1
    for s in mixed:
        k = s.versions.index(new)
        assert 0 < k < len(s.output_ids) and s.versions == [old] * k + [new] * (len(s.versions) - k)
        assert s.logprobs[:k] == pytest.approx(logprobs_under(a, prompt, s.output_ids[:k]), abs=1e-4)
        want_new = logprobs_under(b, prompt, s.output_ids)[k:]
        assert s.logprobs[k:] == pytest.approx(want_new, abs=1e-4)
    if mode == "abort":
        assert engine.resubmitted >= len(mixed)


def test_in_place_pause_keeps_the_old_kv_cache_as_sglang_does(server):
    """in_place (selectable, not the default): running requests resume on KV computed by the old
    weights, so their new-version tokens do NOT match a recomputation under the new weights."""
    a, b = policy(41), policy(42)
    engine = RemoteEngine([SGLangClient(server, name="t-inplace", pause_mode="in_place")])
    prompt = TOK.encode("7+8=")
    for attempt in range(ATTEMPTS):
        engine.update_weights(2 * attempt, a.state_dict())
        engine.add_request(GenRequest(f"p{attempt}", prompt, 16, 48))
        first = collect(engine.step())
        time.sleep(interrupt_delay(attempt))
        engine.update_weights(2 * attempt + 1, b.state_dict())
        mixed = [s for s in run_all(engine, out=first)[f"p{attempt}"].samples if len(set(s.versions)) == 2]
        if mixed:
            break
    assert mixed, f"no sample was interrupted mid-generation in {ATTEMPTS} tries"
    for s in mixed:
        k = s.versions.index(2 * attempt + 1)
        stale = torch.tensor(s.logprobs[k:]) - torch.tensor(logprobs_under(b, prompt, s.output_ids)[k:])
        assert stale.abs().max() > 1e-2


def test_a_killed_server_loses_no_sample_and_comes_back_with_the_current_weights(tmp_path):
    """SIGKILL one of two servers mid-generation: its samples finish on the other; the server,
    started again on the same port, is revived with the newest weights over a new group."""
    (p0, u0), (p1, u1) = start_cpu_server(), start_cpu_server()
    try:
        a = policy(31)
        engine = RemoteEngine(
            [SGLangClient(u0, name="t-kill-0"), SGLangClient(u1, name="t-kill-1")], revive_every_s=0.2
        )
        engine.update_weights(0, a.state_dict())
        prompt = TOK.encode("5+5=")
        n_groups = 4
        for g in range(n_groups):
            engine.add_request(GenRequest(f"g{g}", prompt, 8, 48))
        first = engine.step()  # dispatches every sample; the kill follows at once (~0.1 s of generation left here)
        os.kill(p0.pid, signal.SIGKILL)
        groups = {g.group_id: SimpleNamespace(samples=[plain(s) for s in g.samples()]) for g in first}  # done already
        t = time.monotonic()
        while engine.servers[0].up:  # the in-flight requests fail: the server is marked down
            assert time.monotonic() - t < 120, "the killed server was not marked down"
            if not engine.has_work():  # all done before the kill (a faster server): one more group meets it
                engine.add_request(GenRequest(f"g{n_groups}", prompt, 8, 48))
                n_groups += 1
            groups.update((g.group_id, SimpleNamespace(samples=[plain(s) for s in g.samples()])) for g in engine.step())
        groups.update(run_all(engine))
        assert sorted(groups) == sorted(f"g{g}" for g in range(n_groups))
        for grp in groups.values():
            for s in grp.samples:
                assert s.finish_reason in ("stop", "length") and s.versions == [0] * len(s.output_ids)
                assert len(s.output_ids) == 48 or s.finish_reason == "stop"
                assert s.logprobs == pytest.approx(logprobs_under(a, prompt, s.output_ids), abs=1e-4)
        assert not engine.servers[0].up and engine.resubmitted > 0
        p0.wait(timeout=30)
        p0, _ = start_cpu_server(port=int(u0.rsplit(":", 1)[1]))
        t, n = time.monotonic(), 0
        while not engine.servers[0].up:  # revival is checked while the engine has work
            assert time.monotonic() - t < 120, "the restarted server was never revived"
            if not engine.has_work():
                engine.add_request(GenRequest(f"x{n}", prompt, 1, 2))
                n += 1
            engine.step()
        assert call(u0, "GET", "/model_info")["weight_version"] == "0"
        run_all(engine)
    finally:
        stop(p0)
        stop(p1)


def test_servers_that_refuse_every_update_end_the_engine_naming_their_reason(tmp_path):
    """Two servers holding a smaller model than the policy (the issue's failure: the twin built the tiny model
    where model.path named SmolLM2) refuse every update before the broadcast, as SGLang 0.5.23 refuses a
    declaration its model cannot hold. The engine stops retrying after REFUSALS_TO_FAIL refusals of each
    server and raises ``Unfixable`` with the server's own reason, instead of reviving them for ever."""
    small = tmp_path / "small.yaml"
    small.write_text(to_yaml(load_config(TINY, ["model.hidden_size=64", "model.intermediate_size=128"])))
    servers = [start_cpu_server(small) for _ in range(2)]
    try:
        clients = [SGLangClient(u, name=f"t-refuse-{i}") for i, (_, u) in enumerate(servers)]
        engine = RemoteEngine(clients, revive_every_s=0.2)
        t = time.monotonic()
        engine.update_weights(0, policy(3).state_dict())  # refused by both: down, not yet given up
        assert [s.up for s in engine.servers] == [False, False]
        engine.add_request(GenRequest("g0", TOK.encode("1+1="), 1, 4))
        with pytest.raises(Unfixable) as failed:
            while time.monotonic() - t < 120:
                engine.step()
        took = time.monotonic() - t
        # the tiny policy's embedding: its character vocabulary x 128; the servers' largest parameter is 64 wide
        assert f"every server refused the weights of v0 {REFUSALS_TO_FAIL} times in a row; {servers[0][1]}" in str(
            failed.value
        )
        assert "declared with" in str(failed.value) and "more than the model's largest parameter" in str(failed.value)
        assert took < 30, f"{took:.1f} s to give up"
        assert all(s.refusals >= REFUSALS_TO_FAIL for s in engine.servers)
        engine.close()
    finally:
        for p, _ in servers:
            stop(p)


def test_finish_lets_the_running_requests_end_under_the_old_weights(server):
    """rollout.on_weights=finish (issue 42): the engine holds new samples while the running ones end; the servers
    are then paused with nothing running, and everything after carries the new version."""
    a, b = policy(51), policy(52)
    engine = RemoteEngine([SGLangClient(server, name="t-finish")], on_weights="finish")
    engine.update_weights(0, a.state_dict())
    prompt, later = TOK.encode("7+8="), TOK.encode("2+2=")
    engine.add_request(GenRequest("old", prompt, 4, 24))
    done = {g.group_id: [plain(s) for s in g.samples()] for g in engine.step()}  # dispatched (may end at once)
    engine.hold_new(True)
    engine.add_request(GenRequest("new", later, 4, 24))
    t = time.monotonic()
    while engine.in_flight():
        assert time.monotonic() - t < 120, "the running requests did not end"
        done.update((g.group_id, [plain(s) for s in g.samples()]) for g in engine.step())
    assert list(done) == ["old"] and len(engine.queue) == 4 and not engine.inflight  # "new" never sent
    engine.update_weights(1, b.state_dict())
    engine.hold_new(False)
    done.update((k, v.samples) for k, v in run_all(engine).items())
    for gid, model, version, ids in (("old", a, 0, prompt), ("new", b, 1, later)):
        for s in done[gid]:
            assert s.versions == [version] * len(s.output_ids)
            assert s.logprobs == pytest.approx(logprobs_under(model, ids, s.output_ids), abs=1e-4)


def test_abort_groups_stops_the_requests_at_the_server(server):
    """A group the scheduler cut (a straggler) is forgotten here and aborted at its server (/abort_request by
    rid); the other group finishes as if alone."""
    a = policy(61)
    engine = RemoteEngine([SGLangClient(server, name="t-abort")])
    engine.update_weights(0, a.state_dict())
    prompt = TOK.encode("9+9=")
    engine.add_request(GenRequest("cut", prompt, 8, 56))  # 8 sampled rows: some still run after the first step
    engine.add_request(GenRequest("kept", prompt, 2, 8, greedy=True))
    # dispatched; a fast server may answer within this step: "kept" may end here, and a sampled row of "cut" at an
    # early eos (CI saw one of 1 token)
    first = collect(engine.step())
    ended = [s for s in engine.groups["cut"].samples if s is not None]
    assert all(s.reason == "stop" and len(s.out) < 56 for s in ended) and len(ended) < 8
    # held here: the rows that ended, none of the running ones (their answers have not come back)
    assert engine.abort_groups(["cut", "unknown"]) == {"cut": sum(len(s.out) for s in ended)}
    t = time.monotonic()
    out = run_all(engine, out=first)
    assert list(out) == ["kept"] and time.monotonic() - t < 60
    want = greedy_under(a, prompt, 8)
    assert all(s.output_ids == want for s in out["kept"].samples)
