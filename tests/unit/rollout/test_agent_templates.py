"""Exact tokens across an agent's turns, through the real ``openai`` client and two real chat templates.

The agent is written against ``openai.AsyncOpenAI`` only; the endpoint is the rollout worker's
``OpenAIServer``; the engine is scripted (its completions are given as token ids, and it records the prompt
ids it was handed: the engine's own view). Every expected sequence is built by hand from the template's
pieces (the text between special tokens encoded alone, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2), never by
the code under test:

- SmolLM2-135M-Instruct's own ChatML template (the real-model preset's): two turns, no drift, the trajectory
  equal to the hand-built P1 C1 (P2 - P1 - C1) C2.
- A Qwen2.5/R1-style template with tools (tests/support/data/chat_templates, cited there) that drops
  ``<think>...</think>`` from past assistant turns: the drift detected with its count and position, refused
  under ``refuse``, trained as two hand-computed segments under ``segments``; and an OpenAI tool call parsed,
  answered and rendered back with no drift when the model wrote the JSON as the template does, with drift
  when it did not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest


from areal_async.rollout.agent import AgentWorkflow
from areal_async.rollout.openai_server import OpenAIServer
from areal_async.workflows.agent_trace import DriftRefused
from areal_async.workflows.base import EngineHandle, Generation, Prompt, Sampling
from tests.support.smollm2 import INSTALL, smollm2_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "support" / "data" / "chat_templates"
START, END = 1, 2  # <|im_start|>, <|im_end|> in SmolLM2's vocabulary
SMOL_SYSTEM = "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
KEY = "test-key"


@pytest.fixture(scope="module")
def smol():
    tok = smollm2_tokenizer()
    if tok is None:
        pytest.skip(f"SmolLM2's tokenizer is not installed ({INSTALL})")
    return tok


@pytest.fixture(scope="module")
def r1(smol):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol.name_or_path)
    tok.chat_template = (TEMPLATES / "qwen25_r1_tools.jinja").read_text()
    return tok


class ScriptedEngine(EngineHandle):
    """Completions from a script of token ids (logprob -0.25 each, version 4); keeps every prompt it was given."""

    def __init__(self, tokenizer, completions: list[list[int]]):
        self.tokenizer, self.completions, self.prompts = tokenizer, list(completions), []

    async def generate(self, input_ids, sampling: Sampling) -> Generation:
        self.prompts.append(list(input_ids))
        out = self.completions.pop(0)
        return Generation(list(out), [-0.25] * len(out), [4] * len(out), "stop")

    async def reward(self, completion, solutions):
        raise AssertionError("agents score themselves")


def piece(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def turn(tok, role_and_text: str) -> list[int]:
    """<|im_start|>role\\ntext<|im_end|> then '\\n', by hand."""
    return [START] + piece(tok, role_and_text) + [END] + piece(tok, "\n")


def run_agent(tok, agent, completions, mode="refuse"):
    """One episode of ``agent`` on a fresh server: (the episode or what it raised, engine, trace, server)."""
    engine = ScriptedEngine(tok, completions)

    async def main():
        server = OpenAIServer(tok, "t", (64, 64), "127.0.0.1", KEY)
        flow = AgentWorkflow(agent, "tests:agent", server, mode, KEY, lambda ids: "What is 2+3?")
        try:
            ep = await flow.arun_episode(engine, Prompt("e0p0", [7], ["5"], Sampling(64)))
        except Exception as e:  # the test inspects it
            ep = e
        await server.close()
        return ep, flow.last_trace, server

    ep, trace, server = asyncio.run(main())
    return ep, engine, trace, server


# ---- the agents: written against openai.AsyncOpenAI only ------------------------------------------------
async def two_turn_agent(client, task):
    msgs = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="any-name", messages=msgs, max_tokens=16)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=16, temperature=0)
    return (1.0 if "5" in first.choices[0].message.content else 0.0), {"second": second.choices[0].message.content}


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


async def tool_agent(client, task):
    """The 30-line OpenAI tool loop of docs/agents.md, shortened: call tools until the model answers."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], max_tokens=32)
        m = r.choices[0].message
        if not m.tool_calls:
            return float(task["solutions"][0] in (m.content or ""))
        msgs.append({"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]})
        for c in m.tool_calls:
            args = __import__("json").loads(c.function.arguments)
            msgs.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return 0.0


# ---- SmolLM2's ChatML: exact ----------------------------------------------------------------------------
def test_smollm2_chatml_two_turns_are_exact(smol):
    c1, c2 = piece(smol, "It is 5.") + [END], piece(smol, "Yes.") + [END]
    ep, engine, trace, server = run_agent(smol, two_turn_agent, [c1, c2])
    p1 = turn(smol, SMOL_SYSTEM) + turn(smol, "user\nWhat is 2+3?") + [START] + piece(smol, "assistant\n")
    between = piece(smol, "\n") + turn(smol, "user\nSure?") + [START] + piece(smol, "assistant\n")
    assert engine.prompts == [p1, p1 + c1 + between]  # what the engine was handed, turn by turn
    assert trace.drifts == [] and len(trace.turns) == 2
    assert ep.prompt_ids == p1
    assert ep.output_ids == c1 + between + c2
    assert ep.loss_mask == [1] * len(c1) + [0] * len(between) + [1] * len(c2)
    assert ep.logprobs == [-0.25] * len(c1) + [0.0] * len(between) + [-0.25] * len(c2)
    assert ep.versions == [4] * len(c1) + [-1] * len(between) + [4] * len(c2)
    assert (ep.reward, ep.turns, ep.segment_starts) == (1.0, 2, [])
    assert server.drift.stats() == {"t": {"turns": 2, "drifts": 0, "episodes_with_drift": 0}}


def test_a_non_canonical_sample_is_read_back_as_sampled(smol):
    """The model sampled '5' as two pieces of a merge the tokenizer would make one token ('It' + ' is' vs the
    sampled 'I' 't'): the next prompt carries the sampled ids, not the text's re-tokenization."""
    odd = piece(smol, "I") + piece(smol, "t") + piece(smol, " is 5.")
    assert odd != piece(smol, "It is 5.")  # a tokenization the tokenizer would not make
    c1, c2 = odd + [END], piece(smol, "Yes.") + [END]
    ep, engine, trace, _ = run_agent(smol, two_turn_agent, [c1, c2])
    assert engine.prompts[1][: len(engine.prompts[0]) + len(c1)] == engine.prompts[0] + c1
    assert trace.drifts == [] and ep.output_ids[: len(c1)] == c1


# ---- the Qwen2.5/R1-style template: <think> dropped from the history ------------------------------------
def r1_prompts(tok, answer_in_history: str):
    sys_turn = turn(tok, "system\nYou are a helpful assistant.")
    p1 = sys_turn + turn(tok, "user\nWhat is 2+3?") + [START] + piece(tok, "assistant\n")
    p2 = p1[: -len(piece(tok, "assistant\n"))] + piece(tok, "assistant\n" + answer_in_history) + [END]
    p2 += piece(tok, "\n") + turn(tok, "user\nSure?") + [START] + piece(tok, "assistant\n")
    return p1, p2


def test_r1_template_drift_is_detected_counted_and_refused(r1):
    c1 = piece(r1, "<think>\n2 and 3\n</think>\n5") + [END]
    c2 = piece(r1, "Yes.") + [END]
    ep, engine, trace, server = run_agent(r1, two_turn_agent, [c1, c2], mode="refuse")
    p1, p2 = r1_prompts(r1, "\n5")  # the template keeps what follows </think>: "\n5"
    assert engine.prompts == [p1, p2]  # turn 2 was generated from the template's own render
    assert isinstance(ep, DriftRefused)
    (d,) = trace.drifts
    at = len(p1) + len(piece(r1, "<think>\n2 and 3\n</think>\n5")) - 1
    first_diff = next(i for i, (a, b) in enumerate(zip(p1 + c1, p2)) if a != b)
    assert (d.turn, d.position, d.where) == (1, first_diff, "in the previous completion")
    assert len(p1) <= first_diff <= at
    assert "template_drift" in str(ep) and "rollout.agent_drift=refuse" in str(ep)
    assert server.drift.stats() == {"t": {"turns": 2, "drifts": 1, "episodes_with_drift": 1}}


def test_r1_template_drift_trains_as_two_segments(r1):
    c1 = piece(r1, "<think>\n2 and 3\n</think>\n5") + [END]
    c2 = piece(r1, "Yes.") + [END]
    ep, engine, trace, _ = run_agent(r1, two_turn_agent, [c1, c2], mode="segments")
    p1, p2 = r1_prompts(r1, "\n5")
    assert ep.prompt_ids == p1
    assert ep.output_ids == c1 + p2 + c2  # segment 1: p1 c1; segment 2: its own prompt p2, then c2
    assert ep.segment_starts == [len(c1)]
    assert ep.loss_mask == [1] * len(c1) + [0] * len(p2) + [1] * len(c2)
    assert ep.versions == [4] * len(c1) + [-1] * len(p2) + [4] * len(c2)
    assert ep.problem() is None and len(trace.drifts) == 1


def test_r1_template_without_think_is_exact(r1):
    c1, c2 = piece(r1, "5") + [END], piece(r1, "Yes.") + [END]
    ep, engine, trace, _ = run_agent(r1, two_turn_agent, [c1, c2])
    p1, p2 = r1_prompts(r1, "5")
    assert engine.prompts == [p1, p2] and p2[: len(p1) + len(c1)] == p1 + c1
    assert trace.drifts == [] and ep.output_ids == c1 + p2[len(p1) + len(c1) :] + c2


# ---- tool calls in the OpenAI format --------------------------------------------------------------------
def tools_system(tok) -> list[int]:
    import json

    body = (
        "system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(ADD_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>"
    )
    return turn(tok, body)


def test_a_tool_call_round_trip_is_exact_when_the_model_writes_the_templates_json(r1):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    c1 = piece(r1, call) + [END]
    c2 = piece(r1, "The sum is 5.") + [END]
    ep, engine, trace, _ = run_agent(r1, tool_agent, [c1, c2])
    p1 = tools_system(r1) + turn(r1, "user\nWhat is 2+3?") + [START] + piece(r1, "assistant\n")
    tool_turn = piece(r1, "\n") + [START] + piece(r1, "user\n<tool_response>\n5\n</tool_response>") + [END]
    between = tool_turn + piece(r1, "\n") + [START] + piece(r1, "assistant\n")
    assert engine.prompts == [p1, p1 + c1 + between]
    assert trace.drifts == [] and ep.reward == 1.0 and ep.turns == 2
    assert ep.output_ids == c1 + between + c2


def test_a_tool_call_written_compactly_drifts_when_the_template_reserialises_it(r1):
    c1 = piece(r1, '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>') + [END]
    c2 = piece(r1, "5") + [END]
    ep, engine, trace, _ = run_agent(r1, tool_agent, [c1, c2])
    assert isinstance(ep, DriftRefused) and len(trace.drifts) == 1
    assert trace.drifts[0].where == "in the previous completion"
    # turn 2 was given the template's re-serialised call, not the sampled one
    assert r1.decode(engine.prompts[1]).count('{"name": "add", "arguments": {"a": 2, "b": 3}}') == 1
