"""What the supervisor reads about liveness from the run directory (the scheduler writes both files).

- ``StepWatchdog``: no trainer step (a new ``metrics.jsonl`` row) for ``cluster.step_timeout_s`` once
  the trainer is ready (``status.json``: ``trainer_ready``); before that, no word from the scheduler
  for as long. ``check()`` then names whose work is overdue (the oldest unfinished work and its
  holder, ``scheduler/overdue.py``) and what every worker waits for (``silence_report``).
- ``capture_hang``: before the supervisor acts on the watchdog's finding, every local worker's Python
  stacks go into the run directory (``supervisor/hangs.py``; ``areal-async doctor`` shows them).
- ``lost_log``: the new lines of ``lost.jsonl`` (workers the scheduler declared lost), read as they
  are appended (``base/records.JsonlTail``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from areal_async.base.records import JsonlTail
from areal_async.config import ExperimentConfig
from areal_async.scheduler.overdue import overdue
from areal_async.supervisor.hangs import capture_stacks, file_size
from areal_async.supervisor.launchers import Launched


class StepWatchdog:
    """``check()``: why the run is stuck, or None. ``reset()`` when a new fleet starts (a recovery)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, scheduler_done: Callable[[], bool]):
        self.cfg, self.run_dir, self.scheduler_done = cfg, run_dir, scheduler_done
        self.reset()

    def reset(self) -> None:
        self.fleet_t = time.monotonic()
        self.last_step_t: Optional[float] = None  # None until the trainer of this fleet is ready
        self.metrics_size = -1
        (self.run_dir / "status.json").unlink(missing_ok=True)  # a previous fleet's scheduler wrote it

    def started(self) -> None:
        """Every process of the fleet has been started: the starting clock runs from now. A start that waited
        (the fork server's imports: a minute on a loaded machine) is no silence of the scheduler's."""
        self.fleet_t = time.monotonic()

    def check(self) -> Optional[str]:
        limit = self.cfg.cluster.step_timeout_s
        if limit <= 0 or self.scheduler_done():
            return None
        now = time.monotonic()
        size = file_size(self.run_dir / "metrics.jsonl")
        status, age = read_status(self.run_dir / "status.json")
        if self.last_step_t is None:  # starting (model load, SFT warm-up, a resume's rollback)
            if status is not None and status.get("trainer_ready"):
                self.last_step_t, self.metrics_size = now, size  # the clock starts when the trainer is ready
                return None
            if now - self.fleet_t < limit or (age is not None and age < limit):
                return None  # the scheduler reports on time
            return silence_report(status, age, now - self.fleet_t, self.cfg)
        if size != self.metrics_size:
            self.metrics_size, self.last_step_t = size, now
        if now - self.last_step_t < limit:
            return None
        return silence_report(status, age, now - self.last_step_t, self.cfg)


def capture_hang(run_dir: Path, procs: dict[str, Launched], why: str) -> None:
    """The stacks of every running local process (a Ray or Slurm process is on another node: skipped)."""
    pids = {name: p.pid for name, p in procs.items() if p.on_this_machine and p.poll() is None}
    cap = capture_stacks(run_dir, pids, why)
    got = sorted(w for w, e in cap["workers"].items() if e["dumped"])
    where = run_dir / "stacks"
    print(
        f"\n[areal-async] stacks of {', '.join(got) or 'no worker'} captured in {where} (doctor shows them)",
        file=sys.stderr,
    )


def read_status(path: Path) -> tuple[Optional[dict], Optional[float]]:
    """The scheduler's status.json and its age in seconds (None, None when missing or unreadable)."""
    try:
        age = time.time() - path.stat().st_mtime
        return json.loads(path.read_text()), age
    except (OSError, json.JSONDecodeError):
        return None, None


def silence_report(status: Optional[dict], age: Optional[float], silent_s: float, cfg: ExperimentConfig) -> str:
    """Whose work is overdue (the oldest unfinished work and its holder, ``scheduler/overdue.py``) and what
    every worker waits for, from the scheduler's status; the scheduler itself when its status is stale."""
    head = f"no trainer step for {silent_s:.0f}s (cluster.step_timeout_s={cfg.cluster.step_timeout_s:g})"
    if status is None or age is None or age > max(5.0, 3 * cfg.cluster.heartbeat_s):
        return f"{head}: overdue: scheduler (its status.json is {'missing' if age is None else f'{age:.0f}s old'})"
    workers = status.get("workers", {})
    others = "; ".join(
        f"{wid} waits for {w.get('waiting_for') or '?'} (heartbeat {w.get('silent_s')}s ago)"
        for wid, w in sorted(workers.items())
    )
    who = overdue(status, cfg.cluster.heartbeat_s)
    return f"{head}: overdue: {who}. The scheduler waits for {status.get('waiting_for')}. {others}"


def lost_log(run_dir: Path) -> JsonlTail:
    """The scheduler's records of the workers it declared lost: ``{"worker", "role", "pid", "why"}``."""
    return JsonlTail(run_dir / "lost.jsonl")
