"""What the supervisor tells the user: a dead worker (how it ended, why it is not restarted, the last
lines of its log) on stderr, and at the end of a good run the supervisor's counts (worker restarts,
fleet recoveries) added to the trainer's ``summary.json``, which is printed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from areal_async.base.process import BUILD_FAILED_MARK, UNFIXABLE_MARK


def how_it_ended(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError as e:
        return [f"(cannot read log: {e})"]


def build_failure(log_path: Path) -> str:
    """Why a worker that exited BUILD_FAILED_EXIT_CODE failed: its log's last BUILD_FAILED_MARK or
    UNFIXABLE_MARK line (a build error, or one met at run time that no restart fixes)."""
    for line in reversed(tail(log_path, 40)):
        if BUILD_FAILED_MARK in line:
            return f"it failed to build ({line.split(BUILD_FAILED_MARK, 1)[1]}), which no restart can fix"
        if UNFIXABLE_MARK in line:
            return f"it failed ({line.split(UNFIXABLE_MARK, 1)[1]}), which no restart can fix"
    return "it failed to build (see its log), which no restart can fix"


# What a vLLM server (exec'd, so it exits with vLLM's own code) writes when it refuses its configuration at
# start: vLLM's configs are pydantic dataclasses (vllm/config/*.py), a refused value raises
# pydantic_core.ValidationError ("1 validation error for ModelConfig" then "  Value error, ...") as the
# exception that ends the process, and a bad flag is argparse's "api_server.py: error: ..." (exit 2) as its
# last line. Neither is fixed by starting it again. Only the end of the log counts: the exception that ended
# this life of the server, not a line an earlier request logged.
CONFIG_ERROR = "ValidationError:"
ARGPARSE_ERROR = "api_server.py: error:"
END_LINES = 4  # the exception's message: its line, the validation detail, pydantic's link


def server_config_error(log_path: Path) -> Optional[str]:
    """Why a server refused its configuration at start (from its log's last lines), or None."""
    lines = [x for x in tail(log_path, 80) if x.strip()]
    for i in range(len(lines) - 1, max(-1, len(lines) - 1 - END_LINES), -1):
        if CONFIG_ERROR in lines[i] or ARGPARSE_ERROR in lines[i]:
            detail = [x.strip() for x in lines[i + 1 : i + 3] if x.strip().startswith("Value error")]
            why = (detail[0] if detail else lines[i].strip()).split(" [type=")[0]
            first = why.split(". ", 1)[0]  # its first sentence: vLLM's go on with advice
            first += "" if first == why else "."
            return f"it refused its configuration at start ({first}), which no restart can fix"
    return None


def tell_dead(name: str, pid: int, code: int, what: str, log_path: Path, n_lines: int) -> None:
    """``worker NAME (pid P) exited with code C; WHAT. Last lines of LOG:`` and the lines, on stderr."""
    print(
        f"\n[areal-async] worker {name} (pid {pid}) {how_it_ended(code)}; {what}. Last lines of {log_path}:",
        file=sys.stderr,
    )
    for line in tail(log_path, n_lines):
        print("  | " + line, file=sys.stderr)


def annotate_summary(
    run_dir: Path, restarts: int, recoveries: int, peak_rss_mb: Optional[dict] = None, rss_parts: Optional[dict] = None
) -> None:
    """Add the supervisor's counts (and each worker's peak RSS and its sampled parts, ``memory.PeakRss``)
    to summary.json (nothing when the trainer wrote none)."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    summary.update(restarts=restarts, recoveries=recoveries)
    if peak_rss_mb:
        summary["peak_rss_mb"] = peak_rss_mb
    if rss_parts:
        summary["peak_rss_parts_mb"] = rss_parts
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)


def finish(
    run_dir: Path, code: int, restarts: int, recoveries: int, peak_rss_mb: Optional[dict] = None, rss_parts=None
) -> None:
    """A good run's last word: the annotated summary.json."""
    summary = run_dir / "summary.json"
    if code == 0 and summary.exists():
        annotate_summary(run_dir, restarts, recoveries, peak_rss_mb, rss_parts)
        print(f"[areal-async] done: {summary.read_text().strip()}")
