"""Async speedup: trained samples/s at η = 0 (synchronous) vs η > 0, against the overlap limit.

    python -m benchmarks.async_speedup [--json PATH] [--etas 0 1 2 4] [--steps N] [--quick]
                                       [--config configs/tiny_arith.yaml] [--out DIR]
                                       [--rollout-workers N] [--sync NAME ...] [--sync-sweep]
                                       [key=value overrides ...]

Each η is one real run (``areal-async run CONFIG --no-progress``, run directory under ``--out`` or a
temp dir), same config, seed and fleet shape; only ``rollout.max_head_offpolicyness=η`` differs.
Per run, from ``RUN_DIR/metrics.jsonl`` over the steady window from step ``WARMUP_STEPS`` (start-up,
SFT warm-up and the async backlog filling left out; ``benchmarks/common/metrics.py``): samples/s,
a median-based samples/s (burst-resistant cross-check), time to 0.8 (first full 10-step trailing
mean of ``reward_mean`` >= 0.8; wall s since the end of step 0; null if never), final reward (mean
of the last 10 steps), max staleness.

Phase times of the η = 0 run, per step: t_train = ``train_s + ahead_s + publish_s`` (PPO step with
proximal recompute, plus publishing; ``ahead_s``: its first forward, run while the rewards were
scored, ``actor.forward_ahead``); t_gen = ``step_s - train_s - publish_s`` (admission, weight load,
decoding, transfer, rewards, planning: exactly what an async pipeline may hide); ``t_gen_engine``
(engines' busy s) cross-checks the decode share. ideal limit = (t_gen + t_train - t_ahead) /
max(t_gen, t_train), the η = 0 step over the longer phase;
speedup(η) = samples_per_s(η) / samples_per_s(0); fraction_of_limit = speedup / limit. Not a hard
ceiling: a trainer whose core never idles can need less CPU per step than at η = 0, so
fraction_of_limit can exceed 1.
CPU: a sampler reads each fleet process's CPU time from /proc twice a second by role (scheduler,
trainer, rollout-i, reward-i, reward-pool, supervisor; ``benchmarks/common/cpu.py``): CPU-s per
step. A step cannot be shorter than fleet CPU-s per step / cores, so ``limit_cpu`` = (t_gen +
t_train) / max(t_gen, t_train, cpu_s_per_step(η=0) / cores) shows how much of the gap is the machine.

Two baselines, two framings. ``speedup`` (and the limit) divide by the η = 0 run of the same fleet
as the async runs: what asynchrony buys at a fixed fleet (1 rollout worker by default, so
generation and training each get a core, as each gets its own devices on a GPU cluster).
``speedup_vs_best_sync`` divides by the fastest synchronous run of the session: the fixed fleet's
η = 0 run or an η = 0 run in one of ``SYNC_CONFIGS`` (the knobs that move an η = 0 run here:
rollout workers, placement, the forward run ahead), by default ``BEST_SYNC``, the configuration
that was fastest in a sweep of all of them (``--sync-sweep``; the sweep and its figures are in
``benchmarks/RESULTS.md``). Which one is fastest depends on the machine's load (on a contended
machine unpinned roles win; in a quiet one, per the earlier figures, 2 rollout workers pinned), so
``--sync A B ...`` runs several and the fastest measured in the session is the baseline. A
skeptic's question is the second: how much faster than the best the
project can do without asynchrony. Placement: with 2+ CPUs the async runs pin the trainer to this
process's first CPU and the other roles to the rest (``--no-pin``; a ``cluster.cpu_affinity.*``
override replaces it); the sync configurations place themselves as their names say.

Defaults: η 0 1 2 4, 300 steps each (~8 min on 2 cores, plus the best-sync run); ``--quick``: η 0
and 2, 30 steps, too short for time to 0.8 or a stable final reward. Not covered: GPU engines,
several trainer ranks, generations long enough for interruptible generation to pay. One run per η,
no repeats: each run records the 1-minute load average before it and ``foreign_cpu_frac`` (CPU of
processes outside the benchmark, share of one core); ``--quiet-wait S`` waits up to S s for a
quiet machine.

JSON: one row per η: ``metric`` ("trained_samples_per_s"), ``value``, ``unit`` ("samples/s"),
``eta``, ``samples_per_s``, ``speedup``, ``speedup_vs_best_sync``,
``best_sync_config``, ``limit``, ``fraction_of_limit``, ``final_reward``,
``time_to_0.8`` (s or null), ``steps_to_0.8``, ``staleness_max``, ``t_gen``, ``t_train``, ``t_ahead``,
``t_gen_engine`` (s per step, of the η = 0 run), ``limit_cpu``, ``fraction_of_cpu_limit``,
``cpu_s_per_step`` ({role: CPU s per step} of that run), ``n_cores``, ``samples_per_s_median``,
``steps``, ``n_rollout_workers``, ``seed``, ``loadavg_before``, ``foreign_cpu_frac``,
``meets_target`` (η = 2 target below; null at η = 0), ``bound`` (how the figure is bounded),
``run_dir``; and one ``sync_trained_samples_per_s`` row per sync configuration run
(``sync_config``, ``overrides``). Target on the 2-core CPU machine: at η = 2, fraction_of_limit >= 0.8 with a
final reward no more than 0.05 below the η = 0 run's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from benchmarks.common.cpu import cpu_per_step, wait_quiet
from benchmarks.common.fleet import fleet_meta, placement, run_fleet
from benchmarks.common.metrics import (
    cpu_limit,
    ideal_limit,
    median_samples_per_s,
    phase_times,
    steady_samples_per_s,
    time_to_threshold,
)
from benchmarks.common.rows import Col, print_table, write_rows

THRESHOLD = 0.8
MA_WINDOW = 10
FINAL_WINDOW = 10
WARMUP_STEPS = 5
TARGET_ETA, TARGET_FRACTION, TARGET_REWARD_DROP = 2, 0.80, 0.05
DEFAULT_STEPS, QUICK_STEPS = 300, 30  # 300: the preset's run length
# η = 0 configurations the best synchronous baseline is chosen from: name -> (rollout workers,
# placement: "own" = the trainer on a CPU of its own and the other roles on the rest, "trainer" =
# the trainer pinned and the others anywhere, "none" = nothing pinned; further overrides)
SYNC_CONFIGS = {
    "fixed": (None, "own", []),  # the async runs' fleet (--rollout-workers, the placement below)
    "2rollout_own": (2, "own", []),
    "1rollout_trainer": (1, "trainer", []),
    "2rollout_trainer": (2, "trainer", []),
    "1rollout_none": (1, "none", []),
    "2rollout_none": (2, "none", []),
    "1rollout_own_no_ahead": (1, "own", ["actor.forward_ahead=false"]),
}
BEST_SYNC = "1rollout_none"  # the fastest in the sweep recorded in benchmarks/RESULTS.md (a loaded machine)


# --- configure --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="key=value config overrides (any position) apply to every run"
    )
    ap.add_argument("--json", default=None, help="where to write the JSON list of rows")
    ap.add_argument("--etas", type=int, nargs="+", default=None, help="η values (0 is always run); default 0 1 2 4")
    ap.add_argument("--steps", type=int, default=None, help=f"RL steps per run (default {DEFAULT_STEPS})")
    ap.add_argument("--config", default="configs/tiny_arith.yaml")
    ap.add_argument("--rollout-workers", type=int, default=1, help="cluster.n_rollout_workers (see docstring)")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: η 0 and 2, {QUICK_STEPS} steps (~70 s)")
    ap.add_argument("--out", default=None, help="directory for the run dirs (default: a fresh temp dir, kept)")
    ap.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the trainer to a CPU of its own (see the docstring, 'Placement')",
    )
    ap.add_argument(
        "--sync",
        nargs="+",
        default=None,
        choices=sorted(SYNC_CONFIGS),
        help=f"η = 0 configurations besides the fixed fleet's, the fastest of which is the best-sync baseline "
        f"(default: {BEST_SYNC}; see SYNC_CONFIGS)",
    )
    ap.add_argument("--sync-sweep", action="store_true", help="run every SYNC_CONFIGS entry at η = 0")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each run, wait up to this many seconds for other processes to go quiet",
    )
    return ap


def configure(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments plus ``etas``, ``steps``, ``base`` (overrides of every run), ``meta``
    and ``out_dir``; refuses bad values and taken run directories before anything starts."""
    ap = _parser()
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]  # may sit anywhere, even after --etas 0 1
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.etas = sorted(set([0] + (args.etas or ([0, TARGET_ETA] if args.quick else [0, 1, 2, 4]))))
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if min(args.etas) < 0 or args.steps < WARMUP_STEPS + MA_WINDOW or args.rollout_workers < 1:
        ap.error(
            f"need η >= 0, --steps >= {WARMUP_STEPS + MA_WINDOW}, --rollout-workers >= 1; "
            f"got η={args.etas}, steps={args.steps}, rollout-workers={args.rollout_workers}"
        )
    if any(o.startswith("rollout.max_head_offpolicyness=") for o in overrides):
        ap.error("set η with --etas, not rollout.max_head_offpolicyness=")
    pins = [] if args.no_pin else placement(sorted(os.sched_getaffinity(0)), overrides)
    args.base = [
        f"total_train_steps={args.steps}",
        f"cluster.n_rollout_workers={args.rollout_workers}",
        *pins,
        *overrides,
    ]
    names = sorted(SYNC_CONFIGS) if args.sync_sweep else (args.sync or [BEST_SYNC])
    args.sync_runs = {n: sync_overrides(n, args, overrides) for n in names if n != "fixed"}
    args.meta = {**fleet_meta(args.config, args.base), "steps_requested": args.steps}
    args.out_dir = Path(args.out or tempfile.mkdtemp(prefix="async_speedup-")).resolve()
    dirs = [f"eta{eta}" for eta in args.etas] + [f"sync_{n}" for n in args.sync_runs]
    taken = [str(args.out_dir / d) for d in dirs if (args.out_dir / d).exists()]
    if taken:
        ap.error(f"run directories already exist: {', '.join(taken)}; use a new --out")
    return args


def sync_overrides(name: str, args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The overrides of an η = 0 run in configuration ``name`` (``SYNC_CONFIGS``); the user's
    overrides stay, and a ``cluster.cpu_affinity`` one among them replaces the placement."""
    workers, where, extra = SYNC_CONFIGS[name]
    pins = [] if args.no_pin else placement(sorted(os.sched_getaffinity(0)), overrides)
    pins = {"own": pins, "trainer": pins[:1], "none": []}[where]
    return [
        f"total_train_steps={args.steps}",
        f"cluster.n_rollout_workers={workers or args.rollout_workers}",
        *pins,
        *extra,
        *overrides,
    ]


# --- measure ----------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """One fleet run per η, then one η = 0 run per synchronous configuration, summarized."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = [one_run(args, f"eta{eta}", eta, args.base) for eta in args.etas]
    sync = [one_run(args, f"sync_{n}", 0, ovr) | {"sync_config": n} for n, ovr in args.sync_runs.items()]
    return runs, sync


def one_run(args: argparse.Namespace, name: str, eta: int, overrides: list[str]) -> dict:
    if args.quiet_wait > 0:
        wait_quiet(args.quiet_wait)
    run_dir = args.out_dir / name
    print(f"[async_speedup] {name}: {run_dir}", flush=True)
    res = run_fleet(args.config, overrides + [f"rollout.max_head_offpolicyness={eta}"], run_dir)
    return {
        **summarize_run(eta, res.pop("rows")),
        "run_dir": str(run_dir),
        "overrides": overrides,
        "cpu_s_per_step": cpu_per_step(res.pop("cpu_samples"), WARMUP_STEPS),
        **res,
    }


def summarize_run(eta: int, rows: list[dict], skip: int = WARMUP_STEPS) -> dict:
    """The per-run figures (no comparison yet)."""
    if not rows:
        raise ValueError(f"η={eta}: no metrics rows")
    step, secs = time_to_threshold(rows, THRESHOLD, MA_WINDOW)
    tail = [r["reward_mean"] for r in rows[-FINAL_WINDOW:]]
    return {
        "eta": eta,
        "steps": len(rows),
        "samples_per_s": steady_samples_per_s(rows, skip),
        "time_to_0.8": secs,
        "steps_to_0.8": step,
        "final_reward": sum(tail) / len(tail),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "phases": phase_times(rows, skip),
        "samples_per_s_median": median_samples_per_s(rows, skip),
    }


def compare(runs: list[dict], n_cores: Optional[int] = None, sync: list[dict] = ()) -> dict:
    """Add speedup, limit and fraction_of_limit to every run, against the η = 0 run's phases, and
    ``speedup_vs_best_sync`` against the fastest η = 0 run of all (that one, or one of ``sync``).

    With n_cores and the η = 0 run's ``cpu_s_per_step``, also the CPU-capacity limit."""
    base = next((r for r in runs if r["eta"] == 0), None)
    if base is None:
        raise ValueError(f"an η = 0 run is required as the baseline, got η = {[r['eta'] for r in runs]}")
    ph = base["phases"]
    ahead = ph.get("t_ahead", 0.0)
    limit = ideal_limit(ph["t_gen"], ph["t_train"], ahead)
    cpu = base.get("cpu_s_per_step") or {}
    lim_cpu = cpu_limit(ph["t_gen"], ph["t_train"], sum(cpu.values()), n_cores, ahead) if cpu and n_cores else None
    best = max([base, *sync], key=lambda r: r["samples_per_s"])
    for r in runs:
        r["speedup_vs_best_sync"] = r["samples_per_s"] / best["samples_per_s"]
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        r["fraction_of_limit"] = r["speedup"] / limit
        r["fraction_of_cpu_limit"] = None if lim_cpu is None else r["speedup"] / lim_cpu
        r["reward_drop"] = base["final_reward"] - r["final_reward"]
    return {
        "limit": limit,
        "limit_cpu": lim_cpu,
        "t_gen": ph["t_gen"],
        "t_train": ph["t_train"],
        "t_ahead": ahead,
        "t_gen_engine": ph["t_gen_engine"],
        "cpu_s_per_step": sum(cpu.values()) if cpu else None,
        "n_cores": n_cores,
        "base_final_reward": base["final_reward"],
        "best_sync_config": best.get("sync_config", "fixed"),
        "best_sync_samples_per_s": best["samples_per_s"],
        "best_sync_final_reward": best["final_reward"],
    }


def target_met(run: dict) -> bool:
    return run["fraction_of_limit"] >= TARGET_FRACTION and run["reward_drop"] <= TARGET_REWARD_DROP


# --- rows -------------------------------------------------------------------------------------


def to_rows(runs: list[dict], cmp: dict, meta: dict, sync: list[dict] = ()) -> list[dict]:
    bound = (
        f"ideal overlap limit {cmp['limit']:.3f}x from the η=0 run (t_gen {cmp['t_gen']:.3f}s, "
        f"t_train {cmp['t_train']:.3f}s per step); steady window from step {WARMUP_STEPS}"
    )
    out = []
    for r in runs:
        row = {
            "metric": "trained_samples_per_s",
            "value": r["samples_per_s"],
            "unit": "samples/s",
            "eta": r["eta"],
            "samples_per_s": r["samples_per_s"],
            "speedup": r["speedup"],
            "speedup_vs_best_sync": r["speedup_vs_best_sync"],
            "best_sync_config": cmp["best_sync_config"],
            "best_sync_samples_per_s": cmp["best_sync_samples_per_s"],
            "limit": cmp["limit"],
            "fraction_of_limit": r["fraction_of_limit"],
            "final_reward": r["final_reward"],
            "reward_drop_vs_sync": r["reward_drop"],
            "time_to_0.8": r["time_to_0.8"],
            "steps_to_0.8": r["steps_to_0.8"],
            "staleness_max": r["staleness_max"],
            "t_gen": cmp["t_gen"],
            "t_train": cmp["t_train"],
            "t_ahead": cmp["t_ahead"],
            "t_gen_engine": cmp["t_gen_engine"],
            "steps": r["steps"],
            "samples_per_s_median": r["samples_per_s_median"],
            "limit_cpu": cmp["limit_cpu"],
            "fraction_of_cpu_limit": r["fraction_of_cpu_limit"],
            "n_cores": cmp["n_cores"],
            "meets_target": target_met(r) if r["eta"] else None,
            "bound": bound,
        }
        row.update(
            {
                k: r[k]
                for k in ("cpu_s_per_step", "loadavg_before", "foreign_cpu_frac", "run_dir", "run_wall_s")
                if k in r
            }
        )
        row.update(meta)
        out.append(row)
    return out + [sync_row(r, meta) for r in sync]


def sync_row(r: dict, meta: dict) -> dict:
    """An η = 0 run in one of ``SYNC_CONFIGS``: what the best-sync baseline was chosen from."""
    keys = ("final_reward", "steps", "samples_per_s_median", "loadavg_before", "foreign_cpu_frac", "run_dir")
    return {
        "metric": "sync_trained_samples_per_s",
        "value": r["samples_per_s"],
        "unit": "samples/s",
        "eta": 0,
        "sync_config": r["sync_config"],
        "overrides": r.get("overrides"),
        "cpu_s_per_step": r.get("cpu_s_per_step"),
        **{k: r.get(k) for k in keys},
        **meta,
    }


# --- table ------------------------------------------------------------------------------------


def _cpu_sum(r: dict) -> Optional[float]:
    return sum(r["cpu_s_per_step"].values()) if r.get("cpu_s_per_step") else None


COLUMNS = [
    Col("eta", 3, lambda r: r["eta"]),
    Col("samples/s", 10, lambda r: r["samples_per_s"], ".1f"),
    Col("(median)", 9, lambda r: r["samples_per_s_median"], ".1f"),
    Col("speedup", 8, lambda r: r["speedup"], ".3f"),
    Col("vs best sync", 12, lambda r: r.get("speedup_vs_best_sync"), ".3f"),
    Col("of limit", 9, lambda r: r["fraction_of_limit"], ".1%"),
    Col("of cpu lim", 10, lambda r: r["fraction_of_cpu_limit"], ".1%"),
    Col("t->0.8 s", 9, lambda r: r["time_to_0.8"], ".1f"),
    Col("step", 5, lambda r: r["steps_to_0.8"], "d"),
    Col("final rwd", 9, lambda r: r["final_reward"], ".3f"),
    Col("stale", 5, lambda r: r["staleness_max"]),
    Col("cpu-s/step", 10, _cpu_sum, ".3f"),
    Col("load1", 6, lambda r: r.get("loadavg_before", 0), ".2f"),
    Col("others", 7, lambda r: r.get("foreign_cpu_frac"), ".0%"),
]


def show(runs: list[dict], cmp: dict, meta: dict, sync: list[dict] = ()) -> None:
    print(
        f"\nasync speedup: {meta['config']}, {meta['n_rollout_workers']} rollout worker(s), "
        f"{meta['steps_requested']} steps, batch {meta['batch_samples']} samples, seed {meta['seed']}, "
        f"{meta['cpu_count']} CPUs"
    )
    print(
        "placement: "
        + (", ".join(f"{r} on CPU {c}" for r, c in (meta.get("placement") or {}).items() if c) or "not pinned")
    )
    print(
        f"η=0 phases per step: t_gen {cmp['t_gen']:.3f}s (engine busy {cmp['t_gen_engine']:.3f}s), "
        f"t_train {cmp['t_train']:.3f}s ({cmp['t_ahead']:.3f}s of it run ahead, overlapping t_gen) -> ideal limit "
        f"{cmp['limit']:.3f}x"
    )
    if cmp["limit_cpu"] is not None:
        print(
            f"η=0 CPU per step, all fleet processes: {cmp['cpu_s_per_step']:.3f} CPU-s on {cmp['n_cores']} cores "
            f"-> CPU-capacity limit {cmp['limit_cpu']:.3f}x"
        )
    print_table(runs, COLUMNS)
    for r in sync:
        print(f"  η=0 as {r['sync_config']}: {r['samples_per_s']:.1f} samples/s, final reward {r['final_reward']:.3f}")
    print(
        f"best synchronous configuration: {cmp['best_sync_config']} ({cmp['best_sync_samples_per_s']:.1f} samples/s); "
        "'vs best sync' divides by it"
    )
    tgt = next((r for r in runs if r["eta"] == TARGET_ETA), None)
    if tgt is not None:
        print(
            f"target η={TARGET_ETA}: >= {TARGET_FRACTION:.0%} of limit and final reward >= η=0's - "
            f"{TARGET_REWARD_DROP}: {'met' if target_met(tgt) else 'NOT met'} "
            f"({tgt['fraction_of_limit']:.1%}, reward {tgt['final_reward']:.3f} vs {cmp['base_final_reward']:.3f})"
        )
    for r in runs:
        if r.get("cpu_s_per_step"):
            print(
                f"  η={r['eta']} CPU-s per step by process: "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s_per_step"].items())
            )
    print(
        "others = CPU used by processes outside the benchmark during the run (share of one core); the "
        "figures are only meaningful when it is near 0"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = configure(sys.argv[1:] if argv is None else list(argv))
    runs, sync = measure(args)
    cmp = compare(runs, os.cpu_count(), sync)
    meta = {k: args.meta[k] for k in ("n_rollout_workers", "seed", "batch_samples", "placement")}
    rows = to_rows(runs, cmp, meta, sync)
    show(runs, cmp, args.meta, sync)
    if args.json:
        write_rows(args.json, rows)
        print(f"rows written to {args.json}")
    return rows


if __name__ == "__main__":
    main()
