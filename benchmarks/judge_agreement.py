"""How well ``reward.judge`` judges the judge preset's task (issue 38): agreement, confusion matrix and AUC of a
judge configuration against the task's own scorer on labelled (question, completion) pairs.

    python -m benchmarks.judge_agreement build [--runs /work/runs] [--out benchmarks/results/judge_sets.json]
    python -m benchmarks.judge_agreement eval [--sets ...] [--split eval] [--config configs/smollm2_judge.yaml]

**build** makes two disjoint labelled sets from configs/smollm2_math.yaml's problems (the judge preset's task:
reasoning-gym basic_arithmetic, its seed, ``split_holdout``'s 200 held-out prompts); the label of every pair is
``gym_plain_reward`` (the task's own scorer; 1 when it scores 1.0, else 0). *dev* (what templates were chosen
on): training prompts only, the policy's real completions that fleet runs of smollm2_math dumped
(``RUN/reward_samples``, any version) and 60 made-up ones (right and wrong numbers in seven styles). *eval*
(reported, never tuned on): held-out prompts only, 40 greedy completions of the base policy (version 0) and 40
of the policy after 24 steps of smollm2_math (``areal-async eval`` outputs ``evS1_0``, ``evS1_24``), and 40
made-up ones. The sets are kept in ``benchmarks/results/judge_sets.json`` (a fresh clone has no run dirs).

**eval** judges a split with ``reward/judge.py``'s own ``judge_batch`` (frames of 4, as the pool sends a
group's share) under two configurations: the old one (``RewardConfig``'s defaults: the chat-templated
question with ``judge_verdict: text``, plus that prompt's P(yes) for an AUC) and the one in ``--config``.
Agreement and the confusion matrix read a score > 0.5 as "yes"; AUC is the probability that a right completion
outscores a wrong one (ties count half).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import random
import sys
import time

from areal_async.config import load_config
from areal_async.config.sections import RewardConfig
from areal_async.data.prompts import load_problems, split_holdout
from areal_async.reward import judge
from areal_async.reward.gym_reward import gym_plain_reward  # the 'gym' extra: reasoning-gym
from tests.support.smollm2 import model_dir

MATH = "configs/smollm2_math.yaml"
SETS = "benchmarks/results/judge_sets.json"


def made_up(problems: list, n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """``n`` made-up completions of ``problems``: every other one states the right number."""
    out = []
    for k in range(n):
        p = rng.choice(problems)
        entry = json.loads(p.solutions[0])
        expr, right = entry["metadata"]["expression"], int(entry["answer"])
        v = right if k % 2 == 0 else right + rng.choice([-3, -2, -1, 1, 2, 3, 10])
        x, _, y = expr.split()
        styles = [
            f"{expr} = {v}.",
            f"The answer is {v}.",
            f"{v}",
            f"To calculate {expr}, we work it out, which gives {v}.",
            f"{expr} equals {v}. So the result is {v}.",
            f"To calculate {expr}, we need to take {x} and {y}. This is a simple",
            f"The result of {expr} is {v}",
        ]
        out.append((p.prompt, p.solutions[0], styles[rng.randrange(len(styles))]))
    return out


def dumped(runs: str, prompts: dict) -> list[tuple[str, str, str]]:
    """The completions fleet runs dumped (``reward_samples``) whose prompt is one of ``prompts``."""
    seen = {}
    for f in sorted(glob.glob(f"{runs}/s6/op/*/reward_samples/*.jsonl") + glob.glob(f"{runs}/s7/*/reward_samples/*")):
        for line in open(f):
            r = json.loads(line)
            q = f"Calculate {json.loads(r['solutions'][0])['metadata']['expression']}."
            for c in r["completions"] if q in prompts else []:
                seen[(q, c)] = (q, r["solutions"][0], c)
    return list(seen.values())


def evaluated(runs: str, name: str, prompts: dict) -> list[tuple[str, str, str]]:
    rows = [json.loads(line) for line in open(f"{runs}/s5/{name}/eval.jsonl")]
    assert all(r["prompt"] in prompts for r in rows), name
    return [(r["prompt"], r["solutions"][0], r["completions"][0]) for r in rows]


def labelled(items) -> list[tuple[str, str, str, float]]:
    return [(q, s, c, float(gym_plain_reward(c, [s]) >= 1.0)) for q, s, c in items]


def build(runs: str, out: str) -> None:
    cfg = load_config(MATH)
    problems = load_problems(cfg.train_dataset, cfg.seed)
    train, held = split_holdout(problems, cfg.train_dataset.holdout)
    train_q = {problems[i].prompt: problems[i] for i in train}
    held_q = {p.prompt: p for p in held}
    rng = random.Random(38)
    real = dumped(runs, train_q)
    rng.shuffle(real)
    dev = labelled(real[:100] + made_up(list(train_q.values()), 60, rng))
    rng = random.Random(380)
    real = rng.sample(evaluated(runs, "evS1_0", held_q), 40) + rng.sample(evaluated(runs, "evS1_24", held_q), 40)
    ev = labelled(real + made_up(list(held_q.values()), 40, rng))
    assert not {q for q, *_ in dev} & {q for q, *_ in ev}
    json.dump({"dev": dev, "eval": ev}, open(out, "w"), indent=0)
    print(f"dev {len(dev)} ({sum(r[3] for r in dev):.0f} right), eval {len(ev)} ({sum(r[3] for r in ev):.0f} right)")


def auc(scores: list[float], labels: list[float]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def judged(rows, cfg, model: str) -> list[float]:
    """``judge_batch``'s scores (an error: 0), in frames of 4."""
    judge._STATE.clear()
    kwargs = {**judge.judge_kwargs(cfg), "model": model}
    out = []
    for i in range(0, len(rows), 4):
        part = rows[i : i + 4]
        questions, solutions, completions = ([r[k] for r in part] for k in range(3))
        got = judge.judge_batch(completions, [[s] for s in solutions], questions, **kwargs)
        out += [0.0 if isinstance(g, Exception) else float(g) for g in got]
    return out


def report(name: str, scores: list[float], labels: list[float], wall: float) -> dict:
    said = [s > 0.5 for s in scores]
    cm = {
        k: sum(1 for s, y in zip(said, labels) if (s, bool(y)) == v)
        for k, v in {"tp": (True, True), "fp": (True, False), "fn": (False, True), "tn": (False, False)}.items()
    }
    row = {"judge": name, "n": len(labels), "agree": cm["tp"] + cm["tn"], **cm, "auc": round(auc(scores, labels), 3)}
    print(json.dumps({**row, "wall_s": round(wall, 1)}), flush=True)
    return row


def evaluate(sets: str, split: str, config: str) -> None:
    rows = json.load(open(sets))[split]
    labels = [r[3] for r in rows]
    model = str(model_dir())
    new = load_config(config).reward
    runs = [
        ("old: chat, text verdict", RewardConfig()),
        ("old: chat, P(yes)", RewardConfig(judge_verdict="prob")),
        (f"new: {config}", new),
        ("new, text verdict", dataclasses.replace(new, judge_verdict="text")),
    ]
    for name, cfg in runs:
        t0 = time.monotonic()
        report(name, judged(rows, dataclasses.replace(cfg, judge=model), model), labels, time.monotonic() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.judge_agreement")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--runs", default="/work/runs")
    b.add_argument("--out", default=SETS)
    e = sub.add_parser("eval")
    e.add_argument("--sets", default=SETS)
    e.add_argument("--split", default="eval", choices=("dev", "eval"))
    e.add_argument("--config", default="configs/smollm2_judge.yaml")
    a = ap.parse_args(argv)
    build(a.runs, a.out) if a.cmd == "build" else evaluate(a.sets, a.split, a.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
