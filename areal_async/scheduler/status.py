"""What the scheduler says about the run while it runs: ``RUN_DIR/status.json`` (rewritten every
heartbeat, read by the supervisor's step watchdog) and the ``StatusReport`` it answers a
``StatusRequest`` with (``areal-async status``). Pure functions of the scheduler's books."""

from __future__ import annotations

import os
import time
from typing import Optional

from protocols.messages import StatusReport

from areal_async.scheduler.core import SchedulerCore
from areal_async.scheduler.overdue import open_work, overdue
from areal_async.scheduler.step_rows import StepRows
from areal_async.scheduler.workers import WorkerTable


def status_doc(
    core: SchedulerCore, workers: WorkerTable, rows: StepRows, waiting: str, t0: float, heartbeat_s: float
) -> dict:
    """status.json: what the scheduler (``waiting``) and each worker wait for, the open work, whose work
    is overdue."""
    status = {
        "pid": os.getpid(),
        "wall_s": time.time() - t0,
        "next_step": core.next_step,
        "trainer_ready": core.trainer_ready,
        "trainer_busy": core.trainer_busy,
        "waiting_for": waiting,
        "work": open_work_now(core, rows),
        "workers": workers.status(time.monotonic()),
    }
    status["overdue"] = overdue(status, heartbeat_s)
    return status


def open_work_now(core: SchedulerCore, rows: StepRows) -> dict:
    """The oldest unfinished work of each kind (``scheduler/overdue.py``); the step in training counts
    from its plan or the previous step's end, whichever is later (a step planned ahead waits for it)."""
    step_t = rows.step_t
    plan_t: Optional[float] = max(rows.plan_at.get(core.next_step, step_t), step_t) if core.trainer_busy else None
    return open_work(core, core.clock(), plan_t)


def waiting_for(core: SchedulerCore, has_trainer: bool, rows: StepRows, stopping: bool) -> str:
    """The scheduler's view of what the next trainer step waits for."""
    c, step = core, core.next_step
    if stopping:
        return f"the final checkpoint after step {step - 1}"
    if not c.trainer_ready:
        return "the trainer to be ready" if has_trainer else "the trainer to register and publish its weights"
    if c.trainer_busy and step in c.short_steps:
        n = len(c.batch_groups)
        return (
            f"a revision of step {step}'s plan: {c.p.batch_size - n} of its {c.p.batch_size} groups never reached "
            f"the trainer (their worker died); {len(c.ready)} ready, refilling"
        )
    if c.trainer_busy:
        ago = time.time() - rows.plan_at.get(step, rows.step_t)
        return f"the trainer to finish step {step} (planned {ago:.0f}s ago)"
    scoring = sum(1 for gid in c.deadlines.generated_at if getattr(c.ledger.groups.get(gid), "status", "") == "running")
    return (
        f"{len(c.ready)}/{c.p.batch_size} groups ready for step {step}: {c.running - scoring} generating on "
        f"{len(c.rollouts)} rollout worker(s), {scoring} waiting for a score"
    )


def worker_rows(core: SchedulerCore, workers: WorkerTable, heartbeat_s: float) -> list[dict]:
    """A ``StatusReport``'s workers, by id: the trainer's samples are the ledger's trained count, a
    rollout's version the one it last loaded, its groups those it holds now."""
    now, out = time.monotonic(), []
    for wid in sorted(workers):
        w = workers[wid]
        samples = core.ledger.n_trained if w.role == "trainer" else w.samples
        r = core.rollouts.get(wid)
        versions = {"rollout": getattr(r, "loaded_version", -1), "trainer": core.version}
        held = len(r.groups) if r is not None else 0
        out.append(w.report(now, heartbeat_s, versions.get(w.role, -1), samples, workers.restarts(wid), held))
    return out


def status_report(
    nonce: int,
    core: SchedulerCore,
    workers: WorkerTable,
    counts: dict,
    *,
    total_steps: int,
    finished: bool,
    wall_s: float,
    heartbeat_s: float,
    overdue_now: str,
    weight_update: dict,
) -> StatusReport:
    """The answer to a ``StatusRequest``."""
    return StatusReport(
        nonce=nonce,
        version=core.version,
        next_step=core.next_step,
        total_steps=total_steps,
        finished=finished,
        wall_s=wall_s,
        admitted=counts["admitted"],
        running=core.running,
        ready=len(core.ready),
        stale=counts["stale"],
        samples_trained=core.ledger.n_trained,
        samples_aborted=core.ledger.n_aborted,
        workers=worker_rows(core, workers, heartbeat_s),
        overdue=overdue_now,
        weight_update=weight_update,
    )
