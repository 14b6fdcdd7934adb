"""Threads that follow the work (``cluster.share_cores``) against fixed thread counts, on one fleet.

    python -m benchmarks.share_cores [--json PATH] [--steps N] [--modes fixed1 share fixed2]
                                     [--config configs/smollm2_math.yaml] [--out DIR] [key=value ...]

Each mode is one real run (``areal-async run CONFIG --no-progress``) of the same config, seed and fleet
shape for ``--steps`` steps with the periodic evaluator off; only the threads differ:

    fixed1   cluster.torch_threads=1, share_cores off   (the default before this benchmark's change)
    share    cluster.share_cores=true                   (each busy worker takes its share of the CPUs,
                                                         per layer / engine step; idle OpenMP threads sleep)
    fixed2   cluster.torch_threads=2, share_cores off   (every role two threads: what issue 41 tried)

Per run, over the steps from ``WARMUP_STEPS`` on: the median ``step_s`` (wall seconds of a trainer step),
``train_s`` and ``train_cpu_s`` (the trainer thread's CPU seconds for it: above ``train_s`` only with
more threads than one), the trainer's and the rollout's busy fractions (1 - ``trainer_idle_frac``,
1 - ``rollout_idle_frac``: the health columns of metrics.jsonl), the CPU seconds per step of each role
(``benchmarks/common/cpu.py``, sampled from /proc), and the peak RSS of every worker (``summary.json``,
VmHWM; shared memory a process touched counts in each that touched it: the shm weight segments are in
both the trainer's and the rollout's). Load: the 1-minute load average before each run and
``foreign_cpu_frac`` (CPU of processes outside the benchmark, share of one core).

A skeptic's reading: compare ``step_s`` within one invocation (the runs are back to back; wall time
follows the machine's load), with ``train_cpu_s`` / ``train_s`` beside it (threads actually used) and
the role CPU per step (what the step cost the machine). Not covered: more than one rollout worker,
several trainer ranks, pinned roles.

JSON: one row per mode: ``metric`` ("step_s"), ``value`` (median s), ``unit`` ("s"), ``mode``,
``train_s``, ``train_cpu_s``, ``trainer_busy_frac``, ``rollout_busy_frac``, ``cpu_s_per_step`` ({role:
CPU s}), ``peak_rss_mb`` ({worker: MB}), ``steps``, ``loadavg_before``, ``foreign_cpu_frac``,
``run_wall_s``, ``run_dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common.cpu import cpu_per_step
from benchmarks.common.fleet import run_fleet
from benchmarks.common.rows import Col, print_table, write_rows

MODES = {
    "fixed1": ["cluster.torch_threads=1", "cluster.share_cores=false"],
    "share": ["cluster.torch_threads=1", "cluster.share_cores=true"],
    "fixed2": ["cluster.torch_threads=2", "cluster.share_cores=false"],
}
WARMUP_STEPS = 2  # step 0 waits for the first batch (no backlog yet), step 1 for the pipeline to fill
QUIET = ["evaluator.freq_steps=0", "rollout.dump_to_file=true"]


def median_of(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def measure(config: str, mode: str, steps: int, out: Path, overrides: list[str]) -> dict:
    run_dir = out / f"share-cores-{mode}"
    res = run_fleet(config, [*QUIET, f"total_train_steps={steps}", *MODES[mode], *overrides], run_dir)
    rows = [r for r in res["rows"] if r.get("kind") != "eval" and r["step"] >= WARMUP_STEPS]
    summary = json.loads((run_dir / "summary.json").read_text())
    busy = {k: median_of(rows, f"{k}_idle_frac") for k in ("trainer", "rollout")}
    return {
        "metric": "step_s",
        "value": median_of(rows, "step_s"),
        "unit": "s",
        "mode": mode,
        "train_s": median_of(rows, "train_s"),
        "train_cpu_s": median_of(rows, "train_cpu_s"),
        "trainer_busy_frac": None if busy["trainer"] is None else 1 - busy["trainer"],
        "rollout_busy_frac": None if busy["rollout"] is None else 1 - busy["rollout"],
        "cpu_s_per_step": cpu_per_step(res["cpu_samples"], WARMUP_STEPS),
        "peak_rss_mb": summary.get("peak_rss_mb"),
        "steps": len(rows),
        "loadavg_before": res["loadavg_before"],
        "foreign_cpu_frac": res["foreign_cpu_frac"],
        "run_wall_s": res["run_wall_s"],
        "run_dir": str(run_dir),
    }


COLUMNS = [
    Col("mode", 7, lambda r: r["mode"], left=True),
    Col("step s", 7, lambda r: r["value"], ".1f"),
    Col("train s", 8, lambda r: r["train_s"], ".1f"),
    Col("train cpu s", 12, lambda r: r["train_cpu_s"], ".1f"),
    Col("trainer busy", 13, lambda r: r["trainer_busy_frac"], ".0%"),
    Col("rollout busy", 13, lambda r: r["rollout_busy_frac"], ".0%"),
    Col("trainer RSS MB", 15, lambda r: (r["peak_rss_mb"] or {}).get("trainer")),
    Col("rollout RSS MB", 15, lambda r: (r["peak_rss_mb"] or {}).get("rollout-0")),
    Col("load", 5, lambda r: r["loadavg_before"], ".1f"),
    Col("foreign", 8, lambda r: r["foreign_cpu_frac"], ".2f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2_math.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="share-cores-"))
    rows = [measure(args.config, m, args.steps, out, args.overrides) for m in args.modes]
    print_table(rows, COLUMNS)
    for r in rows:
        print(f"{r['mode']}: CPU s per step {json.dumps({k: round(v, 1) for k, v in r['cpu_s_per_step'].items()})}")
    if args.json:
        write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
