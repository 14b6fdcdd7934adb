"""``areal-async data filter``: keep the prompts whose pass rate under a model lies in a band.

The seed's difficulty filter: sample each problem k times with the model (the base model, or the
policy an RL run of CONFIG starts from), score the samples in the reward pool, and drop what the
model always solves (no learning signal) — ``--band '[0,1)'`` with k = 8 drops the 8/8 problems.
It is ``areal-async eval``'s machinery (``workers/evaluate.py``: template, rollout engine of
``rollout.backend``, killable reward pool, ``evaluator.*`` sampling), so the rates are the ones
eval reports per problem.

The band is an interval written as in maths: ``[a,b]``, ``[a,b)``, ``(a,b]``, ``(a,b)``, or
``a,b`` (closed). Kept problems are written in the training format (prompt, solutions, and the
answer when the input had one); ``OUT.rates.jsonl`` holds every problem's rate and verdict.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_async.app.workers.evaluate import Sampling, check_fits, eval_engine, eval_policy, evaluate
from areal_async.config import ExperimentConfig
from areal_async.data.prompts import load_jsonl, prompt_encoder
from areal_async.reward.pool import RewardPool

_BAND = re.compile(r"^\s*([\[(]?)\s*([0-9.]+)\s*,\s*([0-9.]+)\s*([\])]?)\s*$")


@dataclass(frozen=True)
class Band:
    low: float
    high: float
    low_closed: bool = True
    high_closed: bool = True

    @classmethod
    def parse(cls, text: str) -> "Band":
        m = _BAND.match(text)
        if m is None:
            raise ValueError(f"--band {text!r}: expected an interval like '[0,1)', '(0,1)' or '0.2,0.8'")
        lo, hi = float(m.group(2)), float(m.group(3))
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"--band {text!r}: expected 0 <= low <= high <= 1")
        return cls(lo, hi, m.group(1) != "(", m.group(4) != ")")

    def __contains__(self, rate: float) -> bool:
        above = rate >= self.low if self.low_closed else rate > self.low
        below = rate <= self.high if self.high_closed else rate < self.high
        return above and below

    def __str__(self) -> str:
        return f"{'[' if self.low_closed else '('}{self.low:g},{self.high:g}{']' if self.high_closed else ')'}"


def verdict(rate: float, band: Band) -> str:
    if rate in band:
        return "kept"
    below = rate < band.low or (rate == band.low and not band.low_closed)
    return "too_hard" if below else "too_easy"


def filter_data(cfg: ExperimentConfig, data: str, out: Path, band: Band, model_dir: Optional[str]) -> dict:
    """Evaluate every problem of ``data`` and write the ones in ``band``; returns the counts."""
    model, tok, label = eval_policy(cfg, model_dir)
    problems = load_jsonl(data)
    encode = prompt_encoder(tok, cfg.train_dataset.template)
    check_fits(cfg, problems, encode, model.config.max_position_embeddings)
    engine = eval_engine(cfg, model, tok)
    with RewardPool.from_config(cfg.reward) as pool:
        res = evaluate(engine, tok, encode, problems, pool, Sampling.from_config(cfg))
    verdicts = [verdict(r["pass1"], band) for r in res.rows]
    _write(out, [_record(p) for p, v in zip(problems, verdicts) if v == "kept"])
    _write(
        out.with_name(out.name + ".rates.jsonl"),
        [
            {"index": r["index"], "prompt": r["prompt"], "pass1": r["pass1"], "k": len(r["scores"]), "verdict": v}
            for r, v in zip(res.rows, verdicts)
        ],
    )
    return {
        "model": label,
        "band": str(band),
        "k": res.summary["k"],
        "read": len(problems),
        **{k: verdicts.count(k) for k in ("kept", "too_easy", "too_hard")},
    }


def _record(p) -> dict:
    rec = {"prompt": p.prompt, "solutions": list(p.solutions)}
    return rec | ({"answer": p.answer} if p.answer else {})


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def run_filter(cfg: ExperimentConfig, data: str, out: str, band_text: str, model_dir: Optional[str]) -> int:
    """``areal-async data filter``: 0 after writing; 2 on unusable inputs (message on stderr)."""
    try:
        counts = filter_data(cfg, data, Path(out), Band.parse(band_text), model_dir)
    except (ValueError, OSError) as e:
        print(f"areal-async data filter: error: {e}", file=sys.stderr)
        return 2
    print(
        f"data filter: {counts['read']} problems, k={counts['k']}, band {counts['band']} (model: {counts['model']}): "
        f"{counts['kept']} kept, {counts['too_easy']} too easy, {counts['too_hard']} too hard -> {out} "
        f"(rates: {out}.rates.jsonl)"
    )
    return 0
