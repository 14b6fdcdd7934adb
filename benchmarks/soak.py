"""Soak: a long tiny run with every process's resident memory sampled as it goes.

    python -m benchmarks.soak --json soak.json [--steps 2000] [--early 200]

Runs ``configs/tiny_arith.yaml`` with ``total_train_steps=--steps`` (everything else as the
preset) and samples, about once a second, the RSS (``VmRSS``) of every process the run started:
the supervisor, the scheduler, the trainer, each rollout and reward worker, and the reward
workers' checking processes (summed as ``reward-pool``). One row per process: its RSS at the
first sample at or after step ``--early`` and at the last sample before the final step (the
step of each is in the row; after the final step the fleet shuts down), and the growth
between them in percent. Bounded memory means flat rows. RSS does not depend on how busy the
machine is, but the run's wall time does: it is in the ``soak_wall_s`` row with the load
average before and after the run, the CPU seconds of the fleet and of this sampler
(``own_cpu_s``: every process of the run, reaped) and the ``cluster.retained_heap_mb`` the
workers ran with (freed heap each keeps: part of its RSS).
The ``soak_verify_disagreements`` row is ``areal-async verify`` on the run (the scheduler's books
against the trainer's and the rollouts' own records; must be 0); the exit code is 0 only when the
run exited 0 and verified clean.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from areal_async.api import run_command
from areal_async.app.commands.verify import verify_run
from benchmarks.common.cpu import count_lines, own_cpu_s
from benchmarks.common.fleet import stop
from benchmarks.common.rows import Col, print_table, write_rows

ROOT = Path(__file__).resolve().parents[1]


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (a scan of /proc: ppid links)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def sample(run_dir: Path) -> dict[str, int]:
    """RSS in kB per worker id (reward checking processes summed as 'reward-pool')."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, int] = {}
    for wid, pid in pids.items():
        if (kb := rss_kb(pid)) is not None:
            out[wid] = kb
        if wid.startswith("reward"):
            pool = [k for c in descendants(pid) if (k := rss_kb(c)) is not None]
            if pool:
                out["reward-pool"] = out.get("reward-pool", 0) + sum(pool)
    return out


def soak(steps: int, run_dir: Path, timeout_s: float) -> tuple[list[tuple[int, dict]], dict]:
    cmd = run_command(ROOT / "configs/tiny_arith.yaml", run_dir, [f"total_train_steps={steps}"])
    load, t0, samples, cpu0 = os.getloadavg()[0], time.monotonic(), [], own_cpu_s()
    with open(run_dir.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
        )
        try:
            while proc.poll() is None:
                assert time.monotonic() - t0 < timeout_s, f"soak run exceeded {timeout_s}s"
                got = sample(run_dir)
                if got:
                    samples.append((count_lines(run_dir / "metrics.jsonl"), got))
                time.sleep(1.0)
        except BaseException:
            stop(proc)
            raise
    info = {
        "exit_code": proc.returncode,
        "wall_s": time.monotonic() - t0,
        "cpu_s": own_cpu_s() - cpu0,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg()[0],
        "retained_heap_mb": yaml.safe_load((run_dir / "config.yaml").read_text())["cluster"]["retained_heap_mb"],
    }
    return samples, info


def rows_from(samples: list[tuple[int, dict]], early: int, info: dict, steps: int) -> list[dict]:
    first = next(((s, d) for s, d in samples if s >= early), None)
    # the last reading before the final step: after it the fleet shuts down and frees memory (the
    # trainer read 478 MB there against 604 MB three steps before in the first soak)
    last = max((x for x in samples if x[0] < steps), key=lambda x: x[0], default=None)
    rows = [{"metric": "soak_wall_s", "value": info["wall_s"], "unit": "s", "steps": steps, **info}]
    if first is None or last is None:
        return rows
    for wid in sorted(set(first[1]) & set(last[1])):
        a, b = first[1][wid], last[1][wid]
        rows.append(
            {
                "metric": "soak_rss_growth",
                "value": 100.0 * (b - a) / a,
                "unit": "%",
                "worker": wid,
                "rss_mb_early": a / 1024,
                "rss_mb_end": b / 1024,
                "step_early": first[0],
                "step_end": last[0],
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--early", type=int, default=200, help="the first RSS reading is taken at this step")
    p.add_argument("--timeout-s", type=float, default=7200.0)
    p.add_argument("--run-dir", default="", help="default: a new temp dir")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="soak-")) / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    samples, info = soak(args.steps, run_dir, args.timeout_s)
    (run_dir.parent / "rss_samples.json").write_text(json.dumps(samples))
    rows = rows_from(samples, args.early, info, args.steps)
    rep = verify_run(run_dir)
    rows.append(
        {
            "metric": "soak_verify_disagreements",
            "value": len(rep.problems),
            "unit": "problems",
            "counts": rep.counts,
            "kinds": dict(rep.kinds()),
            "problems": rep.lines(10),
        }
    )
    print_table(
        rows,
        [
            Col("worker", 12, lambda r: r.get("worker", r["metric"]), left=True),
            Col("early MB", 9, lambda r: r.get("rss_mb_early"), ".1f"),
            Col("end MB", 9, lambda r: r.get("rss_mb_end"), ".1f"),
            Col("steps", 11, lambda r: f"{r['step_early']}->{r['step_end']}" if "step_end" in r else None),
            Col("value", 9, lambda r: r["value"], ".2f"),
            Col("unit", 4, lambda r: r["unit"], left=True),
        ],
    )
    if args.json:
        write_rows(args.json, rows)
    print(f"verify: {rep.summary()}")
    print("".join(f"  {x}\n" for x in rep.lines(10)), end="")
    return 0 if info["exit_code"] == 0 and rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
