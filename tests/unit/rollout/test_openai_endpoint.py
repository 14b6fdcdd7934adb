"""The rollout worker's OpenAI-compatible endpoint as a client meets it: the real ``openai`` package against
the real HTTP server on a socket (the embedded character tokenizer; the engine scripted by token ids).

Checked: the run's key is required (401 without it, as the other servers of a run); /v1/models; chat and
text completions with their exact ids; the refusals (stream, n > 1, multi-token stops, an unknown episode)
as OpenAI's 400/404 error objects; ``check-plugin``'s static half for an agent; the group's shared prompt."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

import openai  # the 'agent' extra (scripts/setup.sh installs it)

from areal_async.base.plugins import contract_problem
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.openai_server import OpenAIServer
from areal_async.workflows.agent_trace import share_prompt
from areal_async.workflows.base import EngineHandle, Episode, Generation

KEY = "k-123"


class Echo(EngineHandle):
    """Answers 'ok' + eos (versions 2, 3: weights changed mid-generation), remembering each prompt."""

    def __init__(self, tok):
        self.tokenizer, self.prompts, self.samplings = tok, [], []

    async def generate(self, input_ids, sampling):
        self.prompts.append(list(input_ids))
        self.samplings.append(sampling)
        ids = self.tokenizer.encode("ok", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.5, -0.25, -0.125], [2, 3, 3], "stop")

    async def reward(self, completion, solutions):
        return 0.0


def serve(test):
    """Run ``test(server, engine, base_url)`` against a started server with one open episode."""
    tok = build_char_tokenizer()
    engine = Echo(tok)

    async def main():
        server = OpenAIServer(tok, "char", (8, 16), "127.0.0.1", KEY)
        await server.start()
        url, session = server.open_episode(engine)
        try:
            return await test(server, engine, url, session)
        finally:
            await server.close()

    return asyncio.run(main())


def test_chat_through_the_openai_client_with_exact_ids_and_versions():
    async def test(server, engine, url, session):
        client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
        r = await client.chat.completions.create(
            model="whatever", messages=[{"role": "user", "content": "2+3"}], max_tokens=4, temperature=0, logprobs=True
        )
        await client.close()
        return r, engine, session

    r, engine, session = serve(test)
    tok = build_char_tokenizer()
    prompt = [tok.bos_token_id] + tok.encode("User: 2+3\nAssistant: ", add_special_tokens=False)
    assert engine.prompts == [prompt]
    s = engine.samplings[0]
    assert (s.max_new_tokens, s.greedy) == (4, True)
    assert r.choices[0].message.content == "ok" and r.choices[0].finish_reason == "stop"
    assert r.model == "whatever" and r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 3
    assert [x.logprob for x in r.choices[0].logprobs.content] == [-0.5, -0.25, -0.125]
    assert r.model_extra["prompt_token_ids"] == prompt and r.model_extra["versions"] == [2, 3]
    (t,) = session.trace.turns
    assert t.prompt_ids == prompt and t.gen.output_ids == tok.encode("ok", add_special_tokens=False) + [2]


def test_text_completion_and_models():
    async def test(server, engine, url, session):
        client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
        c = await client.completions.create(model="m", prompt="1+1=", max_tokens=3)
        ids = await client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3)
        models = await client.models.list()
        await client.close()
        return c, ids, models, engine

    c, ids, models, engine = serve(test)
    tok = build_char_tokenizer()
    # the character vocabulary: '1' 22, '+' 16, '=' 34; its encode adds no bos (vLLM's rule: the tokenizer's own)
    assert engine.prompts[0] == [22, 16, 22, 34] == [tok.convert_tokens_to_ids(c) for c in "1+1="]
    assert engine.prompts[1] == [5, 6, 7]
    assert c.choices[0].text == "ok" and c.model_extra["prompt_token_ids"] == engine.prompts[0]
    assert [m.id for m in models.data] == ["areal-policy"]


def _raw(url, body=None, key=KEY, method="POST"):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_refusals_are_openai_error_objects_and_the_key_is_required():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

    async def test(server, engine, url, session):
        loop = asyncio.get_running_loop()
        calls = [
            (url + "/chat/completions", chat, None),
            (url + "/chat/completions", chat, "wrong"),
            (url + "/chat/completions", chat | {"stream": True}, KEY),
            (url + "/chat/completions", chat | {"n": 2}, KEY),
            (url + "/chat/completions", chat | {"stop": ["two tokens"]}, KEY),
            (url + "/chat/completions", {"model": "m", "messages": []}, KEY),
            (server.base_url + "/episodes/nope/v1/chat/completions", chat, KEY),
            (url + "/chat/completions", chat | {"stop": ["\n"]}, KEY),
        ]
        out = [await loop.run_in_executor(None, _raw, u, b, k) for u, b, k in calls]
        out.append(await loop.run_in_executor(None, lambda: _raw(server.base_url + "/health", None, None, "GET")))
        return out, engine

    out, engine = serve(test)
    codes = [c for c, _ in out]
    assert codes == [401, 401, 400, 400, 400, 400, 404, 200, 200]
    assert out[0][1] == {"error": "Unauthorized"}
    assert "stream" in out[2][1]["error"]["message"] and "n=2" in out[3][1]["error"]["message"]
    assert "single token" in out[4][1]["error"]["message"] and "messages" in out[5][1]["error"]["message"]
    assert "no such episode" in out[6][1]["error"]["message"]
    assert engine.samplings[0].stop_token_ids == (build_char_tokenizer().encode("\n", add_special_tokens=False)[0],)
    assert len(engine.prompts) == 1  # only the good request reached the engine


def test_the_openai_client_raises_on_a_bad_key():
    async def test(server, engine, url, session):
        client = openai.AsyncOpenAI(base_url=url, api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        await client.close()
        return engine

    assert serve(test).prompts == []


def test_agent_plugin_contract(tmp_path, monkeypatch):
    (tmp_path / "agents_ok.py").write_text(
        "async def good(client, task):\n    return 1.0\n"
        "def sync(client, task):\n    return 1.0\n"
        "async def one_arg(client):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert contract_problem("agents_ok:good", "agent") == ("agent", None)
    assert "not an async function" in contract_problem("agents_ok:sync", "agent")[1]
    assert "wrong signature" in contract_problem("agents_ok:one_arg", "agent")[1]
    assert contract_problem("agents_ok:missing", "agent")[1].startswith("cannot load")


def test_a_groups_episodes_share_their_common_prompt():
    def ep(prompt, out, starts=()):
        return Episode(list(prompt), list(out), [-1.0] * len(out), [1] * len(out), [1] * len(out), 0.5, 1, "stop",
                       list(starts))  # fmt: skip

    a, b = ep([1, 5, 6, 7], [9, 9]), ep([1, 5, 8], [9, 9, 9])
    a.loss_mask[1] = 0
    a.segment_starts = [1]
    share_prompt([a, b])
    assert a.prompt_ids == b.prompt_ids == [1, 5]
    assert (a.output_ids, a.loss_mask, a.versions) == ([6, 7, 9, 9], [0, 0, 1, 0], [-1, -1, 1, 1])
    assert a.segment_starts == [3]
    assert (b.output_ids, b.loss_mask, b.logprobs) == ([8, 9, 9, 9], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="share no first prompt token"):
        share_prompt([ep([1], [2]), ep([3], [2])])


def test_episodes_that_start_together_share_one_listening_socket():
    async def main():
        server = OpenAIServer(build_char_tokenizer(), "char", (8, 16), "127.0.0.1", KEY)
        urls = await asyncio.gather(*(server.start() for _ in range(5)))
        n = len(server.server.sockets)
        await server.close()
        return urls, n

    urls, n = asyncio.run(main())
    assert len(set(urls)) == 1 and n == 1


def test_check_plugin_tells_an_agent_by_its_async_signature(cli):
    ok = cli("check-plugin", "areal_async.workflows.calculator_agent:calculator_agent")
    assert ok.returncode == 0 and "ok: agent" in ok.stdout and "not run" in ok.stdout
    bad = cli("check-plugin", "areal_async.workflows.calculator_agent:calculator_agent", "--kind", "reward")
    assert bad.returncode == 1  # as a reward fn it binds (completion, solutions) and then fails when run


def test_the_retry_agent_drifts_at_the_unseen_eos_and_trains_as_two_segments():
    """A completions agent never sees the eos that ended its first try: its retry prompt re-renders the history
    without it, so turn 1 does not extend turn 0 (drift in the previous completion, where the eos was); under
    segments the episode is P1 C1 | P2 C2 with P2 the retry prompt as the engine got it."""
    from areal_async.rollout.agent import AgentWorkflow
    from areal_async.workflows.agent_trace import DriftRefused
    from areal_async.workflows.base import Prompt, Sampling
    from areal_async.workflows.calculator_agent import FEEDBACK, calculator_retry_agent

    tok = build_char_tokenizer()
    p1 = [tok.bos_token_id] + [tok.convert_tokens_to_ids(c) for c in "1+1="]

    def episode(mode):
        engine = Echo(tok)

        async def main():
            server = OpenAIServer(tok, "char", (8, 16), "127.0.0.1", KEY)
            flow = AgentWorkflow(calculator_retry_agent, "retry", server, mode, KEY, lambda ids: "1+1=")
            try:
                return await flow.arun_episode(engine, Prompt("e0p0", p1, ["2"], Sampling(8))), flow, engine
            except DriftRefused as e:
                return e, flow, engine
            finally:
                await server.close()

        return asyncio.run(main())

    refused, flow, engine = episode("refuse")
    assert isinstance(refused, DriftRefused) and refused.drift.where == "in the previous completion"
    ok_eos = [tok.convert_tokens_to_ids(c) for c in "ok"] + [tok.eos_token_id]
    p2 = p1 + [tok.convert_tokens_to_ids(c) for c in "ok" + FEEDBACK + "1+1="]
    assert engine.prompts == [p1, p2]  # the second prompt: text re-tokenized, the eos gone
    assert refused.drift.position == len(p1) + 2  # where the eos was
    ep, flow, engine = episode("segments")
    assert ep.prompt_ids == p1 and ep.output_ids == ok_eos + p2 + ok_eos and ep.segment_starts == [len(ok_eos)]
    assert ep.loss_mask == [1] * 3 + [0] * len(p2) + [1] * 3 and ep.turns == 2 and ep.reward == 0.0
    assert flow.stats() == {"agent_turns": 2, "agent_drifts": 1}  # the heartbeat's counts
