"""Rejected frames and refused messages, logged so that a flood of them cannot fill the disk.

A receiver logs each rejection it makes (a frame that does not decode, a message it refuses) through
a ``RejectionLog``. Within one window of ``period_s`` seconds the first ``burst`` rejections of each
(receiver, peer, reason) and at most ``max_lines`` in all are logged in full; the rest are only
counted. When the window closes (checked on every rejection and by ``flush_due``, which a service
calls from its periodic loop; ``flush`` at exit) one count line per (receiver, peer, reason) says how
many there were, the ``max_keys`` largest by name and the rest summed in one line; so the count lines
of a window add up to every rejection it saw. A fuzzer that rotates identities shares the global cap:
at most ``max_lines + max_keys + 1`` lines a window, whatever it sends (before this, 31,863 fuzzed
frames on the control socket wrote 31,701 ERROR lines, 5.6 MB, to ``scheduler.log``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

MAX_TRACKED = 4096  # (receiver, peer, reason) keys counted one by one in a window; more go to one bucket
OTHERS = ("(others)", "(peers past the tracked number)", "any")
_COUNT = "%s: %d rejected (%s) from %s in %.1f s; %d of them logged above"


class RejectionLog:
    """Rate-limited rejection lines and a periodic count per (receiver, peer, reason)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 5,
        max_lines: int = 20,
        max_keys: int = 10,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.burst, self.max_lines, self.max_keys = logger, burst, max_lines, max_keys
        self.period_s, self.clock = period_s, clock
        self.t0 = clock()
        self.counts: dict[tuple, list[int]] = {}  # key -> [rejections, logged in full] in this window
        self.lines = 0

    def reject(self, where: str, peer, reason: str, text: str, *args) -> None:
        """Count one rejection by ``where`` of something from ``peer``; log ``text % args`` unless over a cap."""
        self.flush_due()
        key = (where, repr(peer), reason)
        if key not in self.counts and len(self.counts) >= MAX_TRACKED:
            key = OTHERS
        entry = self.counts.setdefault(key, [0, 0])
        entry[0] += 1
        if entry[1] < self.burst and self.lines < self.max_lines and key != OTHERS:
            entry[1] += 1
            self.lines += 1
            self.log.error(text, *args)

    def flush_due(self) -> None:
        """Close the window if ``period_s`` has passed (count lines, then a fresh window)."""
        if self.clock() - self.t0 >= self.period_s:
            self.flush()

    def flush(self) -> None:
        """Write this window's count lines (nothing if it saw no rejection) and start a new window."""
        now = self.clock()
        span, counts = now - self.t0, self.counts
        self.t0, self.counts, self.lines = now, {}, 0
        ranked = sorted(counts.items(), key=lambda kv: -kv[1][0])
        for (where, peer, reason), (n, logged) in ranked[: self.max_keys]:
            self.log.warning(_COUNT, where, n, reason, peer, span, logged)
        rest = ranked[self.max_keys :]
        if rest:
            n, logged = sum(c[0] for _, c in rest), sum(c[1] for _, c in rest)
            peers = f"{len(rest)} other (receiver, peer, reason)"
            self.log.warning(_COUNT, "(others)", n, "any", peers, span, logged)
