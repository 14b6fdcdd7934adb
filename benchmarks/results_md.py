"""Markdown tables for ``benchmarks/RESULTS.md`` from benchmarks' ``--json`` row files.

    python -m benchmarks.results_md --label "run 1" --commit abc1234 FILE.json [FILE.json ...]

Each file becomes one section: its benchmark (recognised by its metrics), the label, the commit,
the machine (CPUs, model name) and the load the rows recorded, then the benchmark's table. The
figures are the rows' own, rounded for reading; nothing is computed that the rows do not hold
except the null run's column, which is the null rows' value beside the fleet rows'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Callable, Optional

from benchmarks.common.legs import find


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def md_table(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


OVERHEAD_COLS = [
    ("fleet", "ms_per_step_ratio"),
    ("fleet", "ms_per_step_first_leg_ratio"),
    ("fleet", "cpu_ms_per_step_ratio"),
    ("fleet", "cpu_ms_per_step_first_leg_ratio"),
    ("null", "ms_per_step_ratio"),
    ("null", "ms_per_step_first_leg_ratio"),
    ("null", "cpu_ms_per_step_ratio"),
]


def overhead(rows: list[dict]) -> list[str]:
    """Per η and in-process loop: the four fleet ratios and the null run's."""
    etas = sorted({r["eta"] for r in rows if r["metric"].startswith("fleet_vs_inprocess")})
    lines = [
        [str(eta), base] + [_f(find(rows, f"{s}_vs_inprocess_{m}", eta, base)) for s, m in OVERHEAD_COLS]
        for eta in etas
        for base in ("plain", "matched")
    ]
    head = ["η", "baseline", "wall/legs", "wall/first", "CPU/legs", "CPU/first", "null wall/legs"]
    out = md_table(head + ["null wall/first", "null CPU/legs"], lines)
    for r in rows:
        if r["metric"] == "ms_per_step":
            who = f"in-process {r['baseline']}" if r["mode"] == "inprocess" else f"fleet η={r['eta']}"
            legs = " / ".join(f"{x:.1f}" for x in r.get("legs_ms", []))
            out.append(
                f"- {who}: {r['value']:.1f} ms wall, {_f(r.get('cpu_ms'), '.1f')} ms CPU per step"
                + (f" (legs {legs})" if legs else "")
            )
    return out


def data_path(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if "transport" in r:
            detail = f"{r['transport']}: {r['seconds']:.2f} s, CPU-time fraction {r['cpu_fraction']:.3f}"
        elif r["metric"] == "scheduler_service_messages_per_s":
            detail = (
                f"{r['messages_per_cpu_s']:.0f} per CPU-s, {r['steps_per_s']:.0f} steps/s, "
                f"{r['samples_trained_per_s']:.0f} samples/s, bound: {r['bound']}"
            )
        else:
            detail = f"{r['messages_per_cpu_s']:.0f} per CPU-s (bare socket, {r['workers']} workers)"
        lines.append([r["metric"], _f(r["value"], ".3f" if r["unit"] == "fraction" else ".0f"), r["unit"], detail])
    return md_table(["metric", "value", "unit", "detail"], lines)


def async_speedup(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        eta = r["metric"] == "trained_samples_per_s"
        lines.append(
            [
                f"η={r['eta']}" if eta else f"η=0 {r['sync_config']}",
                _f(r["value"], ".1f"),
                _f(r["speedup"]) if eta else "",
                _f(r.get("speedup_vs_best_sync")) if eta else "",
                _f(r["fraction_of_limit"]) if eta else "",
                _f(r["final_reward"]),
                _f(r.get("loadavg_before"), ".1f"),
                _f(r.get("foreign_cpu_frac"), ".2f"),
            ]
        )
    best = next((r.get("best_sync_config") for r in rows if "best_sync_config" in r), None)
    head = ["run", "samples/s", "speedup (fixed fleet)", "vs best sync", "of limit", "final reward", "load1"]
    return md_table(head + ["others (cores)"], lines) + [f"- best synchronous configuration: {best}"]


def trainer_ranks(rows: list[dict]) -> list[str]:
    lines = [
        [r["metric"], _f(r["value"], ".4g"), r["unit"], str(r["cores"]), _f(r.get("forwards_per_step"), ".1f")]
        for r in rows
    ]
    return md_table(["metric", "value", "unit", "cores", "forwards/step"], lines)


def generic(rows: list[dict]) -> list[str]:
    return md_table(["metric", "value", "unit"], [[r["metric"], _f(r["value"], ".4g"), r["unit"]] for r in rows])


RENDERERS: list[tuple[str, Callable[[str], bool], Callable[[list[dict]], list[str]]]] = [
    ("benchmarks.overhead", lambda m: m.startswith("fleet_vs_inprocess"), overhead),
    ("benchmarks.data_path", lambda m: m.startswith(("boba_batch", "scheduler_")), data_path),
    ("benchmarks.async_speedup", lambda m: m == "trained_samples_per_s", async_speedup),
    ("benchmarks.trainer_ranks", lambda m: m.startswith("tokens_per_s_"), trainer_ranks),
]


def render(rows: list[dict], label: str, commit: str, source: str) -> list[str]:
    name, fn = next(((n, f) for n, want, f in RENDERERS if any(want(r["metric"]) for r in rows)), ("rows", generic))
    loads = [r[k] for r in rows for k in ("loadavg_before", "loadavg_after", "load_avg_1m") if r.get(k) is not None]
    load = f"1-minute load average {min(loads):.1f}-{max(loads):.1f}" if loads else "load not recorded"
    head = [
        f"### {name}: {label}",
        "",
        f"Commit `{commit}`, {machine()}, {load} (shared machine), rows: `{source}`.",
        "",
    ]
    return head + fn(rows) + [""]


def machine() -> str:
    model = ""
    try:
        model = next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), ""
        )
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs{' (' + model + ')' if model else ''}, {platform.system()}"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="--json row files")
    ap.add_argument("--label", default="", help="what the run was (e.g. 'run 1 of 2, 23:40 UTC')")
    ap.add_argument("--commit", required=True, help="the commit the rows were measured at")
    args = ap.parse_args(argv)
    for path in args.files:
        rows = json.loads(Path(path).read_text())
        print("\n".join(render(rows, args.label, args.commit, Path(path).name)))


if __name__ == "__main__":
    main()
