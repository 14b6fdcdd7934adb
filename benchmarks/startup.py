"""Start-up of the CPU default: ``areal-async run configs/tiny_arith.yaml total_train_steps=2``, timed from the
moment the command is started (issue 39's must-show 3).

    python -m benchmarks.startup [--runs 3] [--config configs/tiny_arith.yaml] [--json PATH] [key=value ...]

Each run is the real console script (``areal-async`` beside this interpreter) in a fresh run directory.
Seconds from ``Popen`` to each event, every event read from what the run itself writes:

- ``spawned``: ``pids.json`` appears (the supervisor has started every worker; its preflight is behind it);
- ``<role>_ready``: the worker's ``<id> started`` log line (its imports and build are done), per worker;
- ``trainer_ready``: the scheduler's ``trainer ready at version`` line (version 0 published to the rollouts);
- ``first_token``: the first ``first tokens generated`` line of any rollout log (its first engine step ended);
- ``first_step``: the first row of ``metrics.jsonl`` appears (polled every 5 ms: step 0 trained and reported);
- ``total``: the command exits (exit 0 required).

Log lines carry wall-clock milliseconds (``logging``'s asctime); ``Popen`` is stamped with the same clock.
``cpu_s`` is the CPU every process of the run used (``RUSAGE_CHILDREN``: the supervisor reaps its workers);
``cpu_by_role`` the same per role, sampled from /proc every 0.2 s (``TreeCPU``: a process's last 0.2 s is missed).
Rows: one per run and event (``metric`` = ``startup_<event>_s``, ``rep`` = the run's index), per worker ready
(``startup_ready_<worker>_s``) and role CPU (``startup_cpu_<role>_s``), and one median per event (``rep`` =
"median"); ``--leg`` names what the runs measured (e.g. a commit or an override) in every row. The load
average before each run is in its rows (``loadavg_before``); read wall figures beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from benchmarks.common.cpu import TreeCPU
from benchmarks.common.rows import Col, print_table, write_rows

ROOT = Path(__file__).resolve().parents[1]
EVENTS = ("spawned", "trainer_ready", "first_token", "first_step", "total")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> float | None:
    """The wall-clock time (s since the epoch) of a worker's log line, None if it has no stamp."""
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def first_line_time(paths: list[Path], marker: str) -> float | None:
    """The earliest stamp of a line containing ``marker`` across ``paths``."""
    found = []
    for p in paths:
        for line in p.read_text(errors="replace").splitlines():
            if marker in line and (t := log_time(line)) is not None:
                found.append(t)
                break
    return min(found) if found else None


def one_run(config: str, overrides: list[str], run_dir: Path) -> dict:
    """Seconds from Popen to each event of one run, plus its CPU seconds and load."""
    cmd = [str(Path(sys.executable).parent / "areal-async"), "run", config, "--run-dir", str(run_dir), "--no-progress"]
    load = os.getloadavg()[0]
    cpu0 = _children_cpu()
    metrics, first_step = run_dir / "metrics.jsonl", None
    with open(run_dir.with_suffix(".log"), "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd + overrides, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        sampler = TreeCPU(proc.pid, lambda: 0, period_s=0.2)
        sampler.start()
        while proc.poll() is None:
            if first_step is None and metrics.exists() and metrics.stat().st_size > 0:
                first_step = time.time() - t0
            time.sleep(0.005)
        total = time.time() - t0
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"run failed (exit {proc.returncode}): see {run_dir.with_suffix('.log')}")
    logs = run_dir / "logs"
    at = {
        "spawned": (run_dir / "pids.json").stat().st_mtime,
        "trainer_ready": first_line_time([logs / "scheduler.log"], "trainer ready at version"),
        "first_token": first_line_time(sorted(logs.glob("rollout-*.log")), "first tokens generated"),
    }
    ev = {k: (None if v is None else v - t0) for k, v in at.items()} | {"first_step": first_step, "total": total}
    ready = {p.stem: first_line_time([p], f"{p.stem} started") for p in sorted(logs.glob("*.log"))}
    return {
        "events": ev,
        "ready": {k: v - t0 for k, v in ready.items() if v is not None},
        "cpu_s": _children_cpu() - cpu0,
        "cpu_by_role": sampler.samples[-1][1] if sampler.samples else {},
        "load": load,
    }


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def rows_of(runs: list[dict]) -> list[dict]:
    rows = []
    for i, r in enumerate(runs):
        figures = [(f"startup_{e}_s", r["events"][e]) for e in EVENTS] + [("startup_cpu_s", r["cpu_s"])]
        figures += [(f"startup_ready_{w}_s", t) for w, t in r["ready"].items()]
        figures += [(f"startup_cpu_{role}_s", t) for role, t in sorted(r.get("cpu_by_role", {}).items())]
        rows += [{"metric": m, "value": v, "unit": "s", "rep": i, "loadavg_before": r["load"]} for m, v in figures]
    for e in EVENTS:
        vals = [r["events"][e] for r in runs if r["events"][e] is not None]
        rows.append({"metric": f"startup_{e}_s", "value": statistics.median(vals) if vals else None, "unit": "s"})
        rows[-1]["rep"] = "median"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.startup")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", default="configs/tiny_arith.yaml")
    p.add_argument("--json", default=None)
    p.add_argument("--leg", default="", help="a label for what these runs measure (kept in every row)")
    p.add_argument("overrides", nargs="*", help="key=value (total_train_steps=2 is always added first)")
    a = p.parse_args(argv)
    overrides = ["total_train_steps=2", *a.overrides]
    runs = []
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for i in range(a.runs):
            runs.append(one_run(a.config, overrides, Path(tmp) / f"run{i}"))
            print(json.dumps({"run": i} | runs[-1]), file=sys.stderr)
    rows = [r | {"leg": a.leg} for r in rows_of(runs)] if a.leg else rows_of(runs)
    cols = [Col("run", 6, lambda r: r["rep"]), Col("load", 5, lambda r: r.get("loadavg_before"), ".1f")]
    by_run: dict = {}
    for r in rows:
        run = by_run.setdefault(r["rep"], {"rep": r["rep"], "loadavg_before": r.get("loadavg_before")})
        run[r["metric"]] = r["value"]
    for e in (*EVENTS, "cpu"):
        cols.append(Col(e, max(len(e), 7), lambda r, e=e: r.get(f"startup_{e}_s"), ".2f"))
    print_table(list(by_run.values()), cols)
    if a.json:
        write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
