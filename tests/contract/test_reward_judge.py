"""reward.judge on a real model: SmolLM2-135M-Instruct (the real-model presets' checkpoint) judging fixed,
hand-labelled completions of fixed questions in the real reward pool (killable child processes, one batched
left-padded generation a frame, the question passed with each check) gives, completion by completion, the
verdict of a reference written out here: the same prompt (its chat template applied by transformers), a
greedy loop of full forwards one token at a time (no KV cache, no padding, one completion at a time), the
first whole yes/no read by this file's own regex. Its agreement with the hand labels is printed (-s): a
135M judge is weak, and the figure is reported as measured (docs/agents.md), not asserted.

The preset's judge (configs/smollm2_judge.yaml: a plain few-shot prompt, ``judge_verdict: prob``, references
that are reasoning-gym entries) against a reference of its own: the prompt filled in here (the entry's answer
read with json, no chat template), one full forward per completion (no cache, no padding), and P(yes) /
(P(yes) + P(no)) over the tokens that the spellings yes/Yes/YES/no/No/NO (with and without a leading space)
encode to alone; the pool's batched, cached forward must give the same within 1e-4."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from areal_async.config import load_config
from areal_async.config.sections import RewardConfig
from areal_async.reward.pool import RewardPool
from tests.support.smollm2 import INSTALL, model_dir

# (question, reference, completion, hand label: does the completion give the reference's result?)
LABELLED = [
    ("3+4=", "7", "3 + 4 = 7, so the answer is \\boxed{7}.", 1.0),
    ("3+4=", "7", "The answer is 12.", 0.0),
    ("3+4=", "7", "7", 1.0),
    ("3+4=", "7", "I think the result is 8.", 0.0),
    ("3+4=", "7", "Seven.", 1.0),
    ("3+4=", "7", "It is 7 apples.", 1.0),
    ("3+4=", "7", "The answer is \\boxed{9}.", 0.0),
    ("3+4=", "7", "", 0.0),
    ("12+5=", "17", "12 + 5 = 17", 1.0),
    ("12+5=", "17", "12 + 5 = 15", 0.0),
    ("9+9=", "18", "The sum is 18.", 1.0),
    ("9+9=", "18", "The sum is 81.", 0.0),
]
QUESTIONS = [q for q, *_ in LABELLED]
COMPLETIONS = [c for _, _, c, _ in LABELLED]


def reference(path, cfg: RewardConfig) -> list:
    """Per completion: 1.0 / 0.0, or None for no verdict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for q, sol, c, _ in LABELLED:
        body = cfg.judge_template.replace("{completion}", c.strip()).replace("{solution}", sol)
        body = body.replace("{question}", q)
        text = tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        new = []
        with torch.no_grad():
            for _ in range(cfg.judge_max_new_tokens):
                nxt = int(lm(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        m = re.search(r"(?i)\b(yes|no)\b", tok.decode(new, skip_special_tokens=True))
        out.append(None if m is None else float(m.group(1).lower() == "yes"))
    return out


def test_the_pools_judge_equals_the_reference_on_fixed_completions():
    path = model_dir()
    if path is None:
        pytest.skip(f"SmolLM2's package is not installed (scripts/setup.sh: {INSTALL})")
    cfg = RewardConfig(judge=str(path), n_procs=2, timeout_s=120, memory_limit_mb=0)
    with RewardPool.from_config(cfg) as pool:
        outs = asyncio.run(pool.score_many([(c, [sol], q) for q, sol, c, _ in LABELLED]))
    want = reference(path, cfg)
    got = [o.score if o.status == "ok" else None for o in outs]
    assert got == want, [(c, o.status, o.detail) for c, o in zip(COMPLETIONS, outs)]
    assert all(o.status in ("ok", "error") for o in outs)
    assert all("no yes/no verdict" in o.detail for o in outs if o.status == "error")
    agree = [g == label for g, (*_, label) in zip(got, LABELLED)]  # no verdict counts as a disagreement
    print(f"judge vs hand labels: {sum(agree)}/{len(agree)} agree; verdicts {got}")


PRESET = Path(__file__).resolve().parents[2] / "configs" / "smollm2_judge.yaml"
# (question, reference answer, completion, hand label), in the preset's task's words; the reference travels as
# a reasoning-gym entry, as the preset's dataset makes it
GYM_LABELLED = [
    ("Calculate 5 + 3.", "8", "5 + 3 = 8.", 1.0),
    ("Calculate 5 + 3.", "8", "5 + 3 = 9.", 0.0),
    ("Calculate 9 - 4.", "5", "To calculate 9 - 4, we subtract 4 from 9, which gives us 5.", 1.0),
    ("Calculate 9 - 4.", "5", "To calculate 9 - 4, we need to subtract 4 from 9. This is a simple", 0.0),
    ("Calculate 6 * 7.", "42", "The answer is 42.", 1.0),
    ("Calculate 6 * 7.", "42", "6 * 7 = 36.", 0.0),
    ("Calculate 2 - 8.", "-6", "2 - 8 = -6", 1.0),
    ("Calculate 2 - 8.", "-6", "2 - 8 = 6.", 0.0),
]


def entry(answer: str) -> str:
    return json.dumps({"task": "basic_arithmetic", "answer": answer, "metadata": {}})


def single_tokens(tok, spellings) -> list[int]:
    ids = [tok(w, add_special_tokens=False)["input_ids"] for w in spellings]
    return sorted({i[0] for i in ids if len(i) == 1})


def prob_reference(path, cfg: RewardConfig) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yes = single_tokens(tok, ["yes", "Yes", "YES", " yes", " Yes", " YES"])
    no = single_tokens(tok, ["no", "No", "NO", " no", " No", " NO"])
    out = []
    for q, sol, c, _ in GYM_LABELLED:
        answer = json.loads(entry(sol))["answer"]
        body = cfg.judge_template.replace("{question}", q).replace("{completion}", c).replace("{solution}", answer)
        ids = tok(body, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            p = torch.softmax(lm(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        out.append(float(p[yes].sum() / (p[yes].sum() + p[no].sum())))
    return out


def test_the_presets_prob_judge_equals_the_reference_on_fixed_completions():
    path = model_dir()
    if path is None:
        pytest.skip(f"SmolLM2's package is not installed (scripts/setup.sh: {INSTALL})")
    cfg = load_config(PRESET).reward
    assert (cfg.judge_verdict, cfg.judge_chat) == ("prob", False)
    cfg = dataclasses.replace(cfg, judge=str(path), n_procs=2, timeout_s=120)
    with RewardPool.from_config(cfg) as pool:
        outs = asyncio.run(pool.score_many([(c, [entry(sol)], q) for q, sol, c, _ in GYM_LABELLED]))
    assert [o.status for o in outs] == ["ok"] * len(GYM_LABELLED), [o.detail for o in outs]
    want = prob_reference(path, cfg)
    assert [o.score for o in outs] == pytest.approx(want, abs=1e-4)
    pos = [w for w, (*_, label) in zip(want, GYM_LABELLED) if label]
    neg = [w for w, (*_, label) in zip(want, GYM_LABELLED) if not label]
    pairs = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    print(f"prob judge vs hand labels: AUC {pairs:.2f}; scores {[round(w, 3) for w in want]}")
