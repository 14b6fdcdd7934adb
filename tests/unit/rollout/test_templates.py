"""Prompt templates (none | chat | r1) and the max_prompt_len filter, down to the ids an engine receives.

Expected ids are written from the character tokenizer's documented layout, not by calling the
code under test: <bos> = 1, "\\n" = 4, a printable character c = 4 + 1 + (ord(c) - 32).
"""

import asyncio
import json
import logging
import os
import threading

import pytest
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import decode
from protocols.sockets import ipc_endpoint, make_socket, send_message

from areal_async.base.manifest import RunManifest
from areal_async.config import ConfigError, from_dict
from areal_async.data.prompts import Problem, keep_short, prompt_encoder, sft_examples
from areal_async.data.templates import render_prompt_text
from areal_async.models.tokenizer import build_char_tokenizer, load_tokenizer
from areal_async.rollout.engines.engine import RolloutEngine
from areal_async.rollout.service import EngineThread
from areal_async.scheduler.service import SchedulerService

R1_TEXT = "User: 3+4=\nPlease reason step by step, and enclose your final answer in \\boxed{}.\nAssistant: <think>\n"


def char_ids(text: str) -> list[int]:
    return [4 if c == "\n" else 5 + ord(c) - 32 for c in text]


def test_templates_render_the_expected_text_and_ids():
    tok = build_char_tokenizer()
    assert prompt_encoder(tok, "none")("3+4=") == [1, 24, 16, 25, 34]  # "3"=51-27, "+"=43-27, "4", "="
    assert prompt_encoder(tok, "chat")("3+4=") == [1] + char_ids("User: 3+4=\nAssistant: ")
    assert prompt_encoder(tok, "r1")("3+4=") == [1] + char_ids(R1_TEXT)
    # SFT examples carry the same prompt ids; the answer follows the template's "<think>\n"
    ((prompt, answer, mask),) = sft_examples([Problem(0, "3+4=", ("7",), "\\boxed{7}")], tok, "r1")
    assert prompt == [1] + char_ids(R1_TEXT) and answer == char_ids("\\boxed{7}") + [2] and mask == [1] * 10


def test_a_tool_trace_answer_is_its_pieces_with_the_tool_output_masked():
    # the calculator's trace: the model writes "<<3+4=" (6 chars), the tool "7>>" (3), the model "\boxed{7}" (9)
    tok = build_char_tokenizer()
    trace = Problem(0, "3+4=", ("7",), ("<<3+4=", "7>>", "\\boxed{7}"))
    ((prompt, answer, mask),) = sft_examples([trace], tok, "none")
    assert prompt == [1, 24, 16, 25, 34]
    assert answer == char_ids("<<3+4=7>>\\boxed{7}") + [2]
    assert mask == [1] * 6 + [0] * 3 + [1] * 9 + [1]  # eos imitated


def test_r1_adds_no_second_think_when_the_chat_template_has_one(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = tok.chat_template.replace("Assistant: {% endif %}", "Assistant: <think>\n{% endif %}")
    assert render_prompt_text(tok, "1+1=", "r1").endswith("Assistant: <think>\n")
    assert render_prompt_text(tok, "1+1=", "r1").count("<think>") == 1
    tok.save_pretrained(tmp_path)  # the template travels with a saved tokenizer
    assert render_prompt_text(load_tokenizer(str(tmp_path)), "1+1=", "chat") == render_prompt_text(tok, "1+1=", "chat")


def test_a_template_the_tokenizer_cannot_render_is_refused_by_name():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="template 'r1' needs a tokenizer with a chat template"):
        prompt_encoder(tok, "r1")
    with pytest.raises(ConfigError, match="template='alpaca': expected none | chat | r1"):
        from_dict({}, ["train_dataset.template=alpaca"])


def test_keep_short_counts_and_refuses_an_empty_result():
    enc = prompt_encoder(build_char_tokenizer(), "none")
    problems = [Problem(i, p, ("1",)) for i, p in enumerate(["1+1=", "12345+67890=", "2+2="])]
    f = keep_short(problems, enc, max_prompt_len=5)  # "1+1=" -> 5 ids with <bos>; the long one has 13
    assert (f.kept, f.n_dropped, f.longest_dropped) == ([0, 2], 1, 13)
    assert "3 prompts, 1 longer than max_prompt_len=5 tokens filtered out (longest 13), 2 kept" == f.describe()
    with pytest.raises(ValueError, match="max_prompt_len=4: every one of the 3 prompts is longer .shortest 5"):
        keep_short(problems, enc, max_prompt_len=4)


class RecordingEngine(RolloutEngine):
    """Records what the rollout worker's engine thread hands it; generates nothing."""

    def __init__(self):
        self.version, self.requests, self.got = 0, [], threading.Event()

    def add_request(self, req):
        self.requests.append(req)
        self.got.set()

    def step(self):
        return []

    def has_work(self):
        return False

    def update_weights(self, version, state_dict):
        self.version = version

    def abort_all(self):
        return []


async def recv(sock, want, timeout=10.0):
    while True:
        msg = decode(await asyncio.wait_for(sock.recv(), timeout))
        if isinstance(msg, want):
            return msg


async def test_rl_issues_r1_ids_to_the_engine_and_filters_a_long_prompt(tmp_path, caplog):
    """Real scheduler behind a real ROUTER socket, prompts rendered with r1: the one prompt over
    max_prompt_len is never issued and is counted; the other reaches the engine as the exact ids."""
    data = tmp_path / "d.jsonl"
    long_prompt = "1+" * 40 + "1="
    data.write_text("\n".join(json.dumps({"prompt": p, "solutions": ["7"]}) for p in ("3+4=", long_prompt)) + "\n")
    short_len = 1 + len(R1_TEXT)
    cfg = from_dict(
        {},
        [
            f"train_dataset.path={data}",
            "train_dataset.type=jsonl",
            "train_dataset.template=r1",
            f"train_dataset.max_prompt_len={short_len}",
            "train_dataset.batch_size=2",
            "gconfig.n_samples=2",
            "model.max_position_embeddings=512",
        ],
    )
    ep = RunManifest(ipc_endpoint(tmp_path, "c"), ipc_endpoint(tmp_path, "t"), [], str(tmp_path))
    with caplog.at_level(logging.INFO, logger="areal_async.scheduler"):
        svc = SchedulerService(
            cfg,
            ep,
            tmp_path / "run",
            t0=0.0,
            tokenize=prompt_encoder(build_char_tokenizer(), cfg.train_dataset.template),
        )
    longest = short_len - len("3+4=") + len(long_prompt)
    assert (svc.prompts.n_total, svc.prompts.n_dropped, svc.prompts.longest_dropped) == (2, 1, longest)
    assert any("2 prompts, 1 longer than max_prompt_len" in r.getMessage() for r in caplog.records)
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    rollout = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="rollout-0")
    trainer = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="trainer")
    engine = RecordingEngine()
    thread = EngineThread(
        engine, on_groups=lambda groups, reqs: None, on_loaded=lambda v, times: None, max_active_groups=8
    )
    thread.start()
    try:
        await send_message(trainer, M.Register(role="trainer", worker_id="trainer", pid=os.getpid()))
        await send_message(rollout, M.Register(role="rollout", worker_id="rollout-0", pid=os.getpid()))
        await recv(trainer, M.RegisterAck)
        await recv(rollout, M.RegisterAck)
        await send_message(trainer, M.TrainerReady(version=0, next_step=0))
        batch = await recv(rollout, M.Batch)  # eta=2: more than one batch admitted, in one message
        reqs = batch.items()[:2]
        for r in reqs:
            thread.submit(r)
        assert await asyncio.to_thread(engine.got.wait, 5)
        await asyncio.to_thread(lambda: [engine.got.wait(0.1) for _ in range(10) if len(engine.requests) < 2])
        assert {r.prompt_id[-2:] for r in reqs} <= {"p0"}  # the cursor walks the one kept prompt, epoch by epoch
        assert [g.prompt_ids for g in engine.requests] == [[1] + char_ids(R1_TEXT)] * 2
        assert all(g.n == 2 for g in engine.requests)
    finally:
        thread.stopping.set()
        thread.join(5)
        task.cancel()
        rollout.close(0)
        trainer.close(0)
        ctx.term()
        svc.router.sock.close(0)
