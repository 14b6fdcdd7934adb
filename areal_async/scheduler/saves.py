"""When the scheduler asks the trainer for a checkpoint (``saver.freq_steps`` / ``saver.freq_secs``),
which one it asked for and has not seen confirmed, and the newest one confirmed saved."""

from __future__ import annotations

import time
from typing import Optional

from areal_async.config.experiment import SaverConfig


class Saves:
    """``saved``: the newest step confirmed saved (a resumed checkpoint counts; -1: none); ``pending``:
    the step asked for and not yet confirmed (None: none)."""

    def __init__(self, saver: SaverConfig, saved: int):
        self.freq_steps, self.freq_secs = saver.freq_steps, saver.freq_secs
        self.saved = saved
        self.pending: Optional[int] = None
        self.last_ask = time.monotonic()

    def due(self, step: int) -> bool:
        """A save after ``step``: by steps, or by time since the last one asked for."""
        by_steps = self.freq_steps > 0 and (step + 1) % self.freq_steps == 0
        return by_steps or (self.freq_secs > 0 and time.monotonic() - self.last_ask >= self.freq_secs)

    def asked(self, step: int) -> None:
        self.last_ask, self.pending = time.monotonic(), step

    def confirmed(self, step: int) -> None:
        self.saved = max(self.saved, step)
        if self.pending == step:
            self.pending = None
