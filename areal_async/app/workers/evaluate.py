"""Evaluation: pass@1 averaged over k samples per problem, with a 95 % confidence interval.

    problems ──template──> prompt ids ──rollout engine (k samples each)──> completions
             ──reward pool (killable processes, reward.fn)──> scores ──> per-problem rates ──> pass@1 ± CI

Used by ``areal-async eval`` (one model, one data file), by the RL trainer as the periodic
evaluator (``evaluator.freq_steps``: its rows go to metrics.jsonl) and by ``areal-async data
filter`` (the per-problem rates). Sampling follows ``evaluator.*`` (the seed's protocol: k
samples at temperature 0.6, top_p 0.95; or greedy with k = 1) with ``evaluator.max_new_tokens``
(0 = ``gconfig.max_new_tokens``).

The engine is whatever sits behind the rollout-engine seam: the embedded ``TorchEngine`` over a
model in this process (``rollout.backend: torch``), or a ``RemoteEngine`` attached to running
SGLang servers that serve the model being evaluated (``rollout.backend: sglang`` with
``sglang.addresses``). A fresh engine seeded with ``seed`` is made for every evaluation, so the
same weights, problems and settings give the same samples: the CLI and the periodic evaluator
agree on a checkpoint.

The interval treats problems as the sampled unit: with p_i the mean score of problem i over its
k samples, pass@1 = mean(p_i) and its standard error is sd(p_i) / sqrt(N) (sd with N - 1), which
holds both the spread between problems and the sampling noise within each (Var p̂_i includes
p_i(1 - p_i)/k). The 95 % interval is pass@1 ± 1.96 SE clipped to [0, 1]; with one problem there
is no interval (None).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from areal_async.app.workers.policy import initial_policy
from areal_async.base import cores
from areal_async.base.process import setup_torch_process
from areal_async.config import ExperimentConfig
from areal_async.data.prompts import Problem, load_jsonl, load_problems, prompt_encoder, split_holdout
from areal_async.models.tiny import load_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.reward.pool import RewardPool
from areal_async.rollout.engines.engine import GenRequest, RolloutEngine
from areal_async.rollout.clients.remote import RemoteEngine
from areal_async.rollout.clients.sglang_client import SGLangClient
from areal_async.rollout.engines.torch_engine import TorchEngine

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


@dataclass(frozen=True)
class Sampling:
    """How each problem is sampled (from ``evaluator.*``)."""

    k: int
    greedy: bool
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> "Sampling":
        e = cfg.evaluator
        return cls(
            e.n_samples,
            e.greedy,
            e.temperature,
            e.top_p,
            e.max_new_tokens or cfg.gconfig.max_new_tokens,
            tuple(cfg.gconfig.stop_token_ids),
        )

    def request(self, group_id: str, prompt_ids: list[int]) -> GenRequest:
        return GenRequest(
            group_id,
            prompt_ids,
            n=self.k,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            greedy=self.greedy,
            stop_token_ids=self.stop_token_ids,
        ).validate()


@dataclass
class Interval:
    mean: float
    se: Optional[float]
    low: Optional[float]
    high: Optional[float]


def pass1_interval(rates: Sequence[float], z: float = Z95) -> Interval:
    """Mean of the per-problem rates and its normal interval (problems as the sampled unit)."""
    n = len(rates)
    if n == 0:
        raise ValueError("pass@1 of no problems: expected at least one rate")
    mean = sum(rates) / n
    if n < 2:
        return Interval(mean, None, None, None)
    se = math.sqrt(sum((r - mean) ** 2 for r in rates) / (n - 1) / n)
    return Interval(mean, se, max(0.0, mean - z * se), min(1.0, mean + z * se))


@dataclass
class EvalResult:
    rows: list[dict]  # one per problem: index, prompt, solutions, scores, statuses, pass1, completions
    summary: dict  # pass1, ci_low, ci_high, se, n_problems, k, sampling, wall_s


def sample_completions(
    engine: RolloutEngine, decode: Callable[[list[int]], str], prompts: Sequence[list[int]], s: Sampling
) -> list[list[str]]:
    """k decoded completions per prompt, in prompt order (the engine is driven until it is idle)."""
    for i, ids in enumerate(prompts):
        engine.add_request(s.request(f"eval-{i}", ids))
    done = {}
    while engine.has_work():
        cores.pace()  # cluster.share_cores: the periodic evaluator's threads, step by step
        done.update({g.group_id: g for g in engine.step()})
    return [[decode(smp.output_ids) for smp in done[f"eval-{i}"].samples()] for i in range(len(prompts))]


def score_completions(pool, problems: Sequence[Problem], completions: list[list[str]]) -> list[list]:
    """RewardOutcome per completion (the pool's killable children run reward.fn)."""
    items = [(c, list(p.solutions)) for p, cs in zip(problems, completions) for c in cs]
    flat = asyncio.run(pool.score_many(items)) if items else []
    out, i = [], 0
    for cs in completions:
        out.append(flat[i : i + len(cs)])
        i += len(cs)
    return out


def evaluate(engine: RolloutEngine, tok, encode, problems: Sequence[Problem], pool, s: Sampling) -> EvalResult:
    """Sample, score and summarise; ``encode`` is the template's prompt encoder."""
    t0 = time.perf_counter()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    completions = sample_completions(engine, decode, [encode(p.prompt) for p in problems], s)
    outcomes = score_completions(pool, problems, completions)
    rows = [_row(p, cs, os_) for p, cs, os_ in zip(problems, completions, outcomes)]
    ci = pass1_interval([r["pass1"] for r in rows])
    summary = {
        "pass1": ci.mean,
        "ci_low": ci.low,
        "ci_high": ci.high,
        "se": ci.se,
        "n_problems": len(rows),
        "k": s.k,
        "n_samples": sum(len(cs) for cs in completions),
        "greedy": s.greedy,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "not_ok": sum(o.status != "ok" for os_ in outcomes for o in os_),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    return EvalResult(rows, summary)


def _row(p: Problem, completions: list[str], outcomes: list) -> dict:
    scores = [o.score for o in outcomes]
    return {
        "index": p.index,
        "prompt": p.prompt,
        "solutions": list(p.solutions),
        "pass1": sum(scores) / len(scores),
        "scores": scores,
        "statuses": [o.status for o in outcomes],
        "completions": completions,
    }


# ---- what to evaluate -------------------------------------------------------------------------


def eval_problems(cfg: ExperimentConfig, data: Optional[str] = None) -> list[Problem]:
    """``data`` (a training-format jsonl), else ``evaluator.path``, else the held-out problems
    (``train_dataset.holdout``), else the training prompts; the first ``evaluator.max_problems`` of them
    (0 = all). Nothing is filtered: ``check_fits`` refuses a prompt the model cannot hold."""
    path = data or cfg.evaluator.path
    if path:
        problems = load_jsonl(path)
    else:
        problems = load_problems(cfg.train_dataset, cfg.seed)
        problems = split_holdout(problems, cfg.train_dataset.holdout)[1] or problems
    return problems[: cfg.evaluator.max_problems] if cfg.evaluator.max_problems else problems


def check_fits(cfg: ExperimentConfig, problems: Sequence[Problem], encode, max_positions: int) -> None:
    """Every templated prompt + max_new_tokens fits the model's context; else ValueError naming the numbers."""
    new = Sampling.from_config(cfg).max_new_tokens
    longest = max((len(encode(p.prompt)) for p in problems), default=0)
    if longest + new > max_positions:
        raise ValueError(
            f"evaluation needs prompt ({longest} tokens with template "
            f"{cfg.train_dataset.template!r}) + max_new_tokens ({new}) = {longest + new} positions: "
            f"expected <= the model's max_position_embeddings={max_positions}"
        )


def torch_eval_engine(cfg: ExperimentConfig, model, tok) -> TorchEngine:
    """A fresh embedded engine seeded with ``seed``: the same weights give the same samples."""
    return TorchEngine(
        model, tok, device=cfg.cluster.device, seed=cfg.seed, max_batch_groups=cfg.rollout.max_batch_groups
    )


class PeriodicEvaluator:
    """The RL trainer's evaluator: the trained weights put into a model of its own, sampled with
    a fresh ``TorchEngine`` (exactly what ``areal-async eval`` does with a checkpoint of the same
    version), scored in a reward pool of its own.

    The weights are assigned, not copied (``load_state_dict(assign=True)``): the trainer evaluates
    between steps, so nothing changes them while the engine reads them, and a copy cost the trainer a
    second resident model for the rest of the run (SmolLM2-135M: 0.53 GB of its 5.9 GB peak)."""

    def __init__(self, cfg: ExperimentConfig, model, tok, pool):
        self.cfg, self.model, self.tok, self.pool = cfg, model, tok, pool
        self.problems = eval_problems(cfg)
        self.encode = prompt_encoder(tok, cfg.train_dataset.template)
        check_fits(cfg, self.problems, self.encode, model.config.max_position_embeddings)
        self.sampling = Sampling.from_config(cfg)

    def due(self, version: int) -> bool:
        """Version 0, every ``evaluator.freq_steps`` versions, and the last one (``total_train_steps``)."""
        freq = self.cfg.evaluator.freq_steps
        return freq > 0 and (version % freq == 0 or version == self.cfg.total_train_steps)

    def __call__(self, version: int, state_dict: dict) -> dict:
        self.model.load_state_dict(state_dict, assign=True)
        with cores.working():
            res = evaluate(
                torch_eval_engine(self.cfg, self.model, self.tok),
                self.tok,
                self.encode,
                self.problems,
                self.pool,
                self.sampling,
            )
        s = res.summary
        return {
            "eval_pass1": s["pass1"],
            "eval_pass1_ci_low": s["ci_low"],
            "eval_pass1_ci_high": s["ci_high"],
            "eval_n_problems": s["n_problems"],
            "eval_k": s["k"],
            "eval_s": s["wall_s"],
        }

    def close(self) -> None:
        self.pool.close()


# ---- output -----------------------------------------------------------------------------------


def write_result(out_dir: Path, res: EvalResult, meta: dict) -> None:
    """``eval.jsonl`` (one row per problem) and ``eval_summary.json`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "eval.jsonl.tmp", "w", encoding="utf-8") as f:
        for row in res.rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(out_dir / "eval.jsonl.tmp", out_dir / "eval.jsonl")
    (out_dir / "eval_summary.json").write_text(json.dumps(meta | res.summary, indent=1) + "\n")


def summary_table(s: dict, label: str) -> str:
    """A few aligned lines a person reads after ``areal-async eval``."""
    ci = "n/a (one problem)" if s["ci_low"] is None else f"[{s['ci_low']:.4f}, {s['ci_high']:.4f}]"
    mode = "greedy" if s["greedy"] else f"T={s['temperature']} top_p={s['top_p']}"
    lines = [
        ("model", label),
        ("problems", s["n_problems"]),
        ("samples / problem (k)", s["k"]),
        ("sampling", f"{mode}, max_new_tokens={s['max_new_tokens']}"),
        ("pass@1", f"{s['pass1']:.4f}"),
        ("95% CI", ci),
        ("checks not ok (timeout/error)", s["not_ok"]),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    return "\n".join(f"  {k:30s} {v}" for k, v in lines)


# ---- areal-async eval -------------------------------------------------------------------------


def eval_engine(cfg: ExperimentConfig, model, tok) -> RolloutEngine:
    """The engine of ``rollout.backend``: embedded over ``model``, or attached to running SGLang servers."""
    if not cfg.rollout.backend.startswith("sglang"):
        return torch_eval_engine(cfg, model, tok)
    s = cfg.sglang
    if not s.addresses:
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend!r}: eval attaches to running servers that serve the "
            "model to evaluate; set sglang.addresses=[http://host:port, ...]"
        )
    clients = [
        SGLangClient(a, name=f"eval-s{j}", request_timeout_s=s.request_timeout_s) for j, a in enumerate(s.addresses)
    ]
    return RemoteEngine(
        clients,
        max_in_flight=max(1, cfg.rollout.max_concurrent_rollouts),
        down_timeout_s=s.server_down_timeout_s,
        ready_timeout_s=s.update_timeout_s,
    )


def eval_policy(cfg: ExperimentConfig, model_dir: Optional[str]):
    """(model, tokenizer, label): a saved model (a checkpoint, RUN_DIR/model of sft), or the policy an RL
    run of this config starts from (the built or loaded model after its SFT warm-up: version 0)."""
    if model_dir:
        return load_model(model_dir, cfg.model.dtype), load_tokenizer(model_dir), str(model_dir)
    model, tok = initial_policy(cfg)
    return model, tok, f"initial policy (version 0, sft_warmup.steps={cfg.sft_warmup.steps})"


def run_eval(cfg: ExperimentConfig, model_dir: Optional[str], data: Optional[str], out_dir: Path) -> int:
    """``areal-async eval``: 0 after writing eval.jsonl + eval_summary.json; 2 on unusable inputs."""
    setup_torch_process(cfg.cluster)
    try:
        model, tok, label = eval_policy(cfg, model_dir)
        problems = eval_problems(cfg, data)
        encode = prompt_encoder(tok, cfg.train_dataset.template)
        check_fits(cfg, problems, encode, model.config.max_position_embeddings)
        engine = eval_engine(cfg, model, tok)
        pool = RewardPool.from_config(cfg.reward)
    except (ValueError, OSError) as e:  # OSError: a missing model or data file
        print(f"areal-async eval: error: {e}", file=sys.stderr)
        return 2
    try:
        res = evaluate(engine, tok, encode, problems, pool, Sampling.from_config(cfg))
    finally:
        pool.close()
    meta = {
        "model": label,
        "data": data or cfg.evaluator.path or cfg.train_dataset.path or cfg.train_dataset.type,
        "template": cfg.train_dataset.template,
        "seed": cfg.seed,
        "backend": cfg.rollout.backend,
    }
    write_result(out_dir, res, meta)
    print(f"eval: {out_dir}/eval.jsonl (per problem), {out_dir}/eval_summary.json")
    print(summary_table(res.summary, label))
    return 0
