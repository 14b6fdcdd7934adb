"""The supervisor's live progress line (step, reward, staleness, samples/s), drawn from ``metrics.jsonl``.

A terminal gets one line redrawn in place; a log file (stdout not a tty) gets one line per new step. A write
that fails (the terminal hung up: EIO) ends the line, never the run: the supervisor goes on stopping or watching.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional


class ProgressLine:
    def __init__(self, metrics_path: Path, total_steps: int, t0: float, enabled: bool):
        self.metrics_path, self.total_steps, self.t0, self.enabled = metrics_path, total_steps, t0, enabled
        self.last = ""

    def line(self, row: Optional[dict]) -> str:
        if row is None:
            return f"[areal-async] starting fleet ({time.time() - self.t0:5.1f}s)"
        return (
            f"[areal-async] step {row['step'] + 1}/{self.total_steps}  v{row['version']}  "
            f"reward {row['reward_mean']:.3f}  staleness<={row['staleness_max']}  "
            f"{row.get('samples_trained_total', 0) / max(1e-9, row['wall_s']):6.1f} samples/s  "
            f"{row['wall_s']:6.1f}s"
        )

    def draw(self) -> None:
        """Redraw the line if it changed (a log file gets no 'starting' lines, only steps)."""
        if not self.enabled:
            return
        row = last_metrics(self.metrics_path)
        line = self.line(row)
        if line != self.last and (row is not None or sys.stdout.isatty()):
            self._write("\r" + line.ljust(100) if sys.stdout.isatty() else line + "\n")
        self.last = line

    def _write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError:  # the terminal is gone: no more lines
            self.enabled = False

    def done(self) -> None:
        """The final state of the line, and a newline after a terminal's live line."""
        if self.enabled and self.last:
            self.draw()
            if self.enabled and sys.stdout.isatty():
                self._write("\n")


def last_metrics(path: Path) -> Optional[dict]:
    """The newest trainer step's row of ``metrics.jsonl`` (evaluation rows, ``kind: eval``, skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "kind" not in row:
            return row
    return None
