"""Reward pool throughput: boxed arithmetic answers checked by math-verify in killable processes.

    python -m benchmarks.reward_throughput --json out.json [--n 500] [--procs 1 2]

For each pool size, scores ``n`` completions (half right, half wrong, a fixed seed) through
``RewardPool.score_many`` after a warm-up (children started, math-verify imported), and reports
checks/s, p50/p99 check latency (send to reply in the parent, queueing excluded), start-up time
and the number of wrong verdicts (must be 0). Not measured: long chains of thought, hard
symbolic answers, timeouts (see tests/unit/reward/test_reward_pool.py for those).
Each JSON row: metric, value, unit, bound (what limits the figure), n_procs, n.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from areal_async.reward import RewardPool

from benchmarks.common import write_rows

_BOUND = f"CPU: sympy in the child processes ({os.cpu_count()} cores on this machine, shared)"


def make_items(n: int, seed: int = 0) -> list[tuple[str, list[str], float]]:
    """``(completion, solutions, expected score)``; answers as integers or fractions."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        right = a * b if i % 4 else f"\\frac{{{a}}}{{{b}}}"
        answer = right if i % 2 == 0 else f"{rng.randint(1000, 9999)}"
        completion = f"We multiply step by step. ... so the answer is \\boxed{{{answer}}}."
        items.append((completion, [f"\\boxed{{{right}}}"], 1.0 if answer == right else 0.0))
    return items


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def _run(n_procs: int, items, timeout_s: float) -> list[dict]:
    t0 = time.monotonic()
    async with RewardPool(n_procs=n_procs, timeout_s=timeout_s) as pool:
        await pool.score_many([(c, s) for c, s, _ in items[: 2 * n_procs]])  # start + import in every child
        startup_s = time.monotonic() - t0
        t1 = time.monotonic()
        outcomes = await pool.score_many([(c, s) for c, s, _ in items])
        wall_s = time.monotonic() - t1
    return _rows(n_procs, items, outcomes, wall_s, startup_s)


def _rows(n_procs, items, outcomes, wall_s, startup_s) -> list[dict]:
    lat_ms = [o.elapsed_s * 1e3 for o in outcomes]
    wrong = sum(o.status != "ok" or o.score != want for o, (_, _, want) in zip(outcomes, items))
    base = {"n_procs": n_procs, "n": len(items), "bound": _BOUND}
    return [
        {"metric": "checks_per_s", "value": len(items) / wall_s, "unit": "checks/s", **base},
        {"metric": "latency_p50", "value": _percentile(lat_ms, 50), "unit": "ms", **base},
        {"metric": "latency_p99", "value": _percentile(lat_ms, 99), "unit": "ms", **base},
        {"metric": "startup_and_warmup", "value": startup_s, "unit": "s", **base},
        {"metric": "wrong_verdicts", "value": wrong, "unit": "count", **base},
    ]


def _print_table(rows: list[dict]) -> None:
    print(f"{'n_procs':>7}  {'metric':<20} {'value':>10}  unit")
    for r in rows:
        print(f"{r['n_procs']:>7}  {r['metric']:<20} {r['value']:>10.3f}  {r['unit']}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the JSON list of rows")
    ap.add_argument("--n", type=int, default=500, help="completions per pool size")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="pool sizes to measure")
    ap.add_argument("--timeout", type=float, default=5.0, help="per-check timeout_s")
    args = ap.parse_args(argv)
    if args.n < 1 or min(args.procs) < 1:
        ap.error(f"--n and --procs must be >= 1, got n={args.n} procs={args.procs}")
    items = make_items(args.n)
    rows = [row for p in args.procs for row in asyncio.run(_run(p, items, args.timeout))]
    _print_table(rows)
    write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
