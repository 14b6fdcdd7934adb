"""A gate the test controls, for end-to-end tests that act on a live run: the scheduler admits no
group past the first ``steps * batch_size`` until the test opens the gate (creates a file), so the
fleet can train at most ``steps`` steps before the test acts, however fast the machine.

It is a ``sitecustomize`` on PYTHONPATH that patches the scheduler's classes in the scheduler process, or in the
fork server it is forked from (as the fault injections of tests/e2e/test_e2e_liveness.py do). The bound comes
from the staleness books: ``SchedulerCore.accepted`` counts every group that finished generating and was not aborted as
stale (trained ones included), ``running`` the groups still out, and a trainer step takes
``batch_size`` accepted groups; so with ``accepted + running <= steps * batch_size`` no more than
``steps`` steps can be trained. Aborted groups (deadline, lost worker) free their slot, so their
prompts are still re-issued while the gate is shut. Once the gate is open the scheduler admits
as usual (and is driven once, since an idle fleet sends it nothing but heartbeats); a fleet
relaunched by recovery runs the same patch and finds the gate open. While it is shut the test may
let the fleet go a few steps further (``Gate.allow``: the limit raised to that many steps, the
scheduler driven once for each raise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SITECUSTOMIZE = """
import os
import sys
# the scheduler started as `python -m workers.scheduler`, or the fork server it is forked from (cluster.fork_server:
# only the scheduler runs these classes; a forked child starts no interpreter, so nothing would patch it there)
if any(m in getattr(sys, "orig_argv", []) for m in ("workers.scheduler", "areal_async.supervisor.zygote")):
    sys.path.insert(0, os.getcwd())  # the checkout the fleet runs from (as `python -m` would put first)
    from areal_async.scheduler import core, service

    GATE, LIMIT, BATCH = {gate!r}, {limit}, {batch_size}
    ALLOWED = GATE + ".steps"  # Gate.allow: the steps the test lets the fleet train while the gate is shut
    _budget = core.SchedulerCore._budget

    def limit():  # the groups the fleet may have accepted or running while the gate is shut
        try:
            with open(ALLOWED) as f:
                return max(LIMIT, int(f.read()) * BATCH)
        except (OSError, ValueError):
            return LIMIT

    def budget(self):  # the groups admission may start now: none past limit() while the gate is shut
        n = _budget(self)
        return n if os.path.exists(GATE) else min(n, limit() - self.accepted - self.running)

    core.SchedulerCore._budget = budget
    _expire_groups = service.SchedulerService._expire_groups

    async def expire_groups(self):  # called every heartbeat_s by the scheduler's watchdog
        await _expire_groups(self)
        state = "open" if os.path.exists(GATE) else limit()  # driven once for each change: opened, or raised
        if state != getattr(self, "_gate_driven", LIMIT):
            self._gate_driven = state
            if not self.stopping and not self.done.is_set():
                await self._drive()

    service.SchedulerService._expire_groups = expire_groups
"""


@dataclass
class Gate:
    env: dict  # the environment to start the fleet with
    path: Path  # the gate: open once it exists

    def open(self) -> None:
        self.path.touch()

    def allow(self, steps: int) -> None:
        """The gate still shut, let the fleet train up to ``steps`` steps (never fewer than it was made with)."""
        tmp = self.path.with_name("steps.tmp")
        tmp.write_text(str(steps))
        os.replace(tmp, self.path.with_name(self.path.name + ".steps"))  # read whole or not at all


def admission_gate(tmp_path: Path, steps: int, batch_size: int = 4) -> Gate:
    """A shut gate letting the fleet train at most ``steps`` steps of ``batch_size`` groups."""
    d = tmp_path / "gate"
    d.mkdir()
    path = d / "open"
    code = SITECUSTOMIZE.format(gate=str(path), limit=steps * batch_size, batch_size=batch_size)
    (d / "sitecustomize.py").write_text(code)
    pythonpath = os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH", "")) if p)
    return Gate(env=dict(os.environ, PYTHONPATH=pythonpath), path=path)
