"""Off-policy at full speed (issue 42): the same fleet under each ``rollout.on_weights`` mode and with
``rollout.over_provision``, side by side.

    python -m benchmarks.off_policy run MODE --config CONFIG --out DIR [--seed S] [key=value ...]
    python -m benchmarks.off_policy table DIR [DIR ...] [--target R] [--json PATH]

``run`` is one fleet (``areal-async run CONFIG --no-progress``, ``benchmarks/common/fleet.py``: the load
average before it and the CPU of processes outside it are kept in ``DIR/bench.json``), so a sitting can put
each run under its own lock. MODES: ``recompute`` (today's default: no override), ``keep``, ``finish``,
``over`` (recompute with ``rollout.over_provision=0.25``), ``keep+over``. Same config, seed and fleet
otherwise: the baseline gets every optimisation the preset has.

``table`` reads each run's ``metrics.jsonl`` (no process is started) and prints, per run:

- ``gen_tok_s``: output tokens generated and booked (``trained_tokens + wasted_tokens`` of the rows after
  the first) per wall second from the end of step 0 to the last step (start-up left out);
- ``wasted_per_trained``: sum of ``wasted_tokens`` / sum of ``trained_tokens`` over the run;
- ``wu_p50``: median ``weight_update_s`` over the versions the rows report (optimizer step end -> every
  rollout generating with the weights), with the medians of its ``recompute_s`` and ``drain_s`` phases;
- ``tail_p50``: median ``tail_s``;
- ``steps_to_target`` / ``wall_to_target``: the first step whose 10-step trailing mean ``reward_mean``
  reaches ``--target`` (wall s since the start; null if never), and the same on the evaluation rows
  (``eval_pass1`` >= target) when the run has them;
- ``pass1_end``: the last evaluation row's ``eval_pass1`` (the held-out set, with its 95 % interval).

JSON: one row per run, ``metric`` "gen_tokens_per_s", ``value``, ``unit`` "tokens/s", the columns above,
``mode``, ``seed``, ``steps``, ``loadavg_before``, ``foreign_cpu_frac``, ``run_dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

from benchmarks.common.fleet import run_fleet
from benchmarks.common.rows import Col, write_rows
from benchmarks.common.rows import print_table as show

MODES = {
    "recompute": [],
    "keep": ["rollout.on_weights=keep"],
    "finish": ["rollout.on_weights=finish"],
    "over": ["rollout.over_provision=0.25"],
    "keep+over": ["rollout.on_weights=keep", "rollout.over_provision=0.25"],
}
WINDOW = 10  # steps of the trailing reward mean judged against the target


def read_rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step rows, evaluation rows) of a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "kind" not in r], [r for r in rows if r.get("kind") == "eval"]


def median_of(rows: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def per_version(rows: list[dict]) -> list[dict]:
    """One row per weight version the rows report (a step row repeats the last complete update)."""
    seen, out = set(), []
    for r in rows:
        v = r.get("weight_update_version")
        if v is not None and v not in seen:
            seen.add(v)
            out.append(r)
    return out


def to_target(steps: list[dict], evals: list[dict], target: float) -> dict:
    """Steps and wall seconds until the trailing reward mean, and the evaluation, reach ``target``."""
    out = {"steps_to_target": None, "wall_to_target": None, "eval_steps_to_target": None, "eval_wall_to_target": None}
    for i in range(WINDOW - 1, len(steps)):
        window = steps[i - WINDOW + 1 : i + 1]
        if sum(r["reward_mean"] for r in window) / WINDOW >= target:
            out["steps_to_target"], out["wall_to_target"] = steps[i]["step"] + 1, steps[i]["wall_s"]
            break
    for e in evals:
        if e.get("eval_pass1", -1) >= target:
            out["eval_steps_to_target"], out["eval_wall_to_target"] = e["version"], e.get("wall_s")
            break
    return out


def summarize(run_dir: Path, target: float) -> dict:
    steps, evals = read_rows(run_dir)
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: fewer than 2 step rows in metrics.jsonl; nothing to measure")
    later = steps[1:]
    tokens = sum(r.get("trained_tokens", 0) + r.get("wasted_tokens", 0) for r in later)
    span = later[-1]["wall_s"] - steps[0]["wall_s"]
    trained = sum(r.get("trained_tokens", 0) for r in steps)
    updates = per_version(steps)
    meta = json.loads((run_dir / "bench.json").read_text()) if (run_dir / "bench.json").exists() else {}
    last = evals[-1] if evals else {}
    return {
        "metric": "gen_tokens_per_s",
        "value": tokens / span if span > 0 else None,
        "unit": "tokens/s",
        "mode": meta.get("mode", run_dir.name),
        "seed": meta.get("seed"),
        "steps": len(steps),
        "gen_tok_s": tokens / span if span > 0 else None,
        "wasted_per_trained": sum(r.get("wasted_tokens", 0) for r in steps) / trained if trained else None,
        "wu_p50": median_of(updates, "weight_update_s"),
        "recompute_p50": median_of(updates, "weight_update_recompute_s"),
        "drain_p50": median_of(updates, "weight_update_drain_s"),
        "tail_p50": median_of(steps, "tail_s"),
        "reward_last10": sum(r["reward_mean"] for r in steps[-WINDOW:]) / len(steps[-WINDOW:]),
        "pass1_end": last.get("eval_pass1"),
        "pass1_end_ci": [last.get("eval_pass1_ci_low"), last.get("eval_pass1_ci_high")] if last else None,
        "wall_s": steps[-1]["wall_s"],
        "loadavg_before": meta.get("loadavg_before"),
        "foreign_cpu_frac": meta.get("foreign_cpu_frac"),
        "run_dir": str(run_dir),
    } | to_target(steps, evals, target)


def print_table(rows: list[dict]) -> None:
    show(
        rows,
        [
            Col("mode", 10, lambda r: r["mode"], left=True),
            Col("seed", 4, lambda r: r["seed"]),
            Col("steps", 5, lambda r: r["steps"]),
            Col("gen tok/s", 9, lambda r: r["gen_tok_s"], ".1f"),
            Col("wasted/trained", 14, lambda r: r["wasted_per_trained"], ".3f"),
            Col("wu p50 s", 8, lambda r: r["wu_p50"], ".2f"),
            Col("recomp p50", 10, lambda r: r["recompute_p50"], ".2f"),
            Col("drain p50", 9, lambda r: r["drain_p50"], ".2f"),
            Col("tail p50", 8, lambda r: r["tail_p50"], ".2f"),
            Col("steps->tgt", 10, lambda r: r["steps_to_target"]),
            Col("wall->tgt", 9, lambda r: r["wall_to_target"], ".0f"),
            Col("pass@1 end", 10, lambda r: r["pass1_end"], ".3f"),
            Col("reward last10", 13, lambda r: r["reward_last10"], ".3f"),
            Col("wall s", 6, lambda r: r["wall_s"], ".0f"),
            Col("load", 4, lambda r: r["loadavg_before"], ".1f"),
        ],
    )


def run_one(mode: str, config: str, out: Path, seed: Optional[int], overrides: list[str]) -> None:
    extra = MODES[mode] + ([f"seed={seed}"] if seed is not None else []) + overrides
    res = run_fleet(config, extra, out, timeout_s=3600.0)
    meta = {k: res[k] for k in ("loadavg_before", "foreign_cpu_frac", "run_wall_s", "cpu_s")}
    (out / "bench.json").write_text(json.dumps(meta | {"mode": mode, "seed": seed, "overrides": extra}))
    rows, load = len(res["rows"]), meta["loadavg_before"]
    print(f"{mode} seed {seed}: {rows} rows, {res['run_wall_s']:.0f} s, load average before {load:.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("mode", choices=sorted(MODES))
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--seed", type=int)
    r.add_argument("overrides", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+", type=Path)
    t.add_argument("--target", type=float, default=0.5)
    t.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "run":
        run_one(a.mode, a.config, a.out, a.seed, a.overrides)
        return 0
    rows = [summarize(d, a.target) for d in a.dirs]
    print_table(rows)
    if a.json:
        write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
