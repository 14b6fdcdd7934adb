"""The run's rows: the metrics row of each trainer step (one line of ``metrics.jsonl``), built by the
scheduler from its books when the step's ``TrainStepDone`` arrives, with the clock the rows measure
from (the previous step's end, each step's plan time); and the books' part of ``summary.json``."""

from __future__ import annotations

import logging
import time
from operator import attrgetter
from typing import Optional

from protocols.messages import TrainStepDone

from areal_async.data.prompts import LengthFilter
from areal_async.scheduler.core import SchedulerCore
from areal_async.scheduler.health import IdleMeter, sample_health, trainer_idle
from areal_async.scheduler.runlog import RunLog
from areal_async.scheduler.task_book import TaskBook
from areal_async.scheduler.weight_updates import WeightUpdates, metrics_columns
from areal_async.scheduler.workers import WorkerTable

log = logging.getLogger("areal_async.scheduler")


class StepRows:
    """``row(m, trained)`` per step; ``step_t``: wall time the last step ended (or the start);
    ``plan_at``: step -> wall time its BatchPlan was sent (two with plan ahead)."""

    def __init__(
        self,
        core: SchedulerCore,
        counts: dict,
        workers: WorkerTable,
        weight_updates: WeightUpdates,
        t0: float,
        task_book: Optional[TaskBook] = None,
        eta: int = 0,
    ):
        self.core, self.counts, self.workers, self.weight_updates, self.t0 = core, counts, workers, weight_updates, t0
        self.task_book = task_book  # a reasoning-gym mixture's per-task columns
        self.eta = eta  # rollout.max_head_offpolicyness, for health.py's staleness columns
        self._idle = {"rollout": IdleMeter(), "reward": IdleMeter()}  # health.py's idle fractions
        self.step_t = time.time()
        self.plan_at: dict[int, float] = {}
        self._filter_last = {"groups": 0, "samples": 0, "errors": 0}  # rollout.dynamic_filter's counts at the last row
        self._scored_last = [0.0, 0]  # core.scored at the last row
        self._skipped_last = 0  # core.memory.skipped_draws at the last row
        self._wasted_last = core.tail.wasted  # the long tail's wasted tokens at the last row (long_tail.py)

    def row(self, m: TrainStepDone, trained: list) -> dict:
        """Step ``m.step``'s row: ``trained`` (its samples' ledger records), the books, the workers' busy
        seconds, the weight update, the dynamic filter's drops, then the trainer's own metrics."""
        now, n = time.time(), len(trained)
        vmins = list(map(attrgetter("version_min"), trained))
        row = {
            "step": m.step,
            "version": m.version,
            "reward_mean": sum(map(attrgetter("score"), trained)) / max(1, n),
            "staleness_max": m.step - min(vmins) if vmins else 0,
            "staleness_mean": (m.step * n - sum(vmins)) / max(1, n),
            "samples_trained": len(trained),
            "samples_trained_total": self.core.ledger.n_trained,
            "samples_generated_total": self.counts["generated"],
            "samples_rewarded_total": self.counts["rewarded"],
            "samples_aborted_total": self.core.ledger.n_aborted,
            "step_s": now - self.step_t,
            "wall_s": now - self.t0,
            # from the previous step's end to this step's plan: waiting for data (t_gen at eta=0)
            "plan_wait_s": max(0.0, self.plan_at.pop(m.step, now) - self.step_t),  # 0: planned ahead
            # rollout engines' cumulative busy seconds, from their last heartbeats
            "gen_busy_s_total": self.workers.busy_s_total("rollout"),
            # reward workers' cumulative seconds with a group being scored, likewise
            "reward_busy_s_total": self.workers.busy_s_total("reward"),
            # completions the reward workers scored and their checks' summed wall time (a judge's cost)
            "reward_checks_total": int(self.workers.stat_total("reward", "checks")),
            "reward_check_s_total": round(self.workers.stat_total("reward", "check_s"), 4),
        }
        self.step_t = now
        row.update(self._long_tail(m.step, trained))
        row.update(metrics_columns(self.weight_updates.last))
        row.update(self._filter_counts())
        row.update(self._memory_counts())
        if self.task_book is not None:
            row.update(self.task_book.step_row(trained))
        (total, n), (total0, n0) = self.core.scored, self._scored_last
        self._scored_last = list(self.core.scored)
        if n > n0:  # every sample scored since the last row, kept or dropped: what the policy generates now
            row["reward_mean_scored"] = (total - total0) / (n - n0)
        row.update({k: v for k, v in m.metrics.items() if k not in row})
        return row | self._health(row, trained)

    def _long_tail(self, step: int, trained: list) -> dict:
        """``tail_s``, and output tokens generated and never trained since the last row beside those trained."""
        tail = self.core.tail
        wasted, self._wasted_last = tail.wasted - self._wasted_last, tail.wasted
        return {
            "tail_s": tail.take_tail(step),
            "wasted_tokens": wasted,
            "wasted_tokens_total": tail.wasted,
            "trained_tokens": sum(map(attrgetter("n_output_tokens"), trained)),
        }

    def _health(self, row: dict, trained: list) -> dict:
        """scheduler/health.py's columns: truncation, lengths, group rewards, idle fractions."""
        out = sample_health(trained, row["step"], self.eta)
        idle = {"trainer_idle_frac": trainer_idle(row, row["step_s"])}
        for (role, meter), busy in zip(self._idle.items(), ("gen_busy_s_total", "reward_busy_s_total")):
            n = len(self.workers.role(role))
            idle[f"{role}_idle_frac"] = meter.add(row["wall_s"], n, row[busy])
        return out | {k: v for k, v in idle.items() if v is not None}

    def _filter_counts(self) -> dict:
        """rollout.dynamic_filter's drops since the last row and in total (nothing without a filter)."""
        f = self.core.p.group_filter
        if f is None:
            return {}
        now, last = f.counts(), self._filter_last
        self._filter_last = now
        if now["errors"] > last["errors"]:
            log.warning("%d dynamic filter error(s) this step, last: %s", now["errors"] - last["errors"], f.last_error)
        return {
            "dynamic_filter_groups_dropped": now["groups"] - last["groups"],
            "dynamic_filter_samples_dropped": now["samples"] - last["samples"],
            "dynamic_filter_groups_dropped_total": now["groups"],
            "dynamic_filter_errors_total": now["errors"],
        }

    def _memory_counts(self) -> dict:
        """rollout.skip_solved_after's books: cursor draws passed over since the last row and in total, prompts
        settled now, and (when any) the problem indices that settled since the last row, by name."""
        mem = self.core.memory
        if mem is None:
            return {}
        total, last = mem.skipped_draws, self._skipped_last
        self._skipped_last = total
        new = mem.take_new()
        return {
            "prompts_skipped": total - last,
            "prompts_skipped_total": total,
            "prompts_settled": len(mem.settled_set),
        } | ({"prompts_settled_new": new} if new else {})


def run_summary(core: SchedulerCore, runlog: RunLog, prompts: LengthFilter, aborted_at_end: int, t0: float) -> dict:
    """The books' part of ``summary.json`` at the run's end."""
    c = core.ledger.counts()
    return {
        "steps": core.next_step,
        "version": core.version,
        "samples_issued": c["issued"],
        "samples_trained": c["trained"],
        "samples_aborted": c["aborted"],
        "samples_lost": c["issued"] - runlog.n_sample_lines,
        "aborted_at_end": aborted_at_end,
        "prompts_total": prompts.n_total,
        "prompts_filtered_long": prompts.n_dropped,
        "prompts_reissued": core.n_reissued["prompts"],
        "samples_reissued": core.n_reissued["samples"],
        "prompts_dropped": core.n_reissued["dropped"],
        "wall_s": time.time() - t0,
    } | _memory_summary(core)


def _memory_summary(core: SchedulerCore) -> dict:
    """rollout.skip_solved_after's totals: draws skipped, and the prompts settled at the end by problem index."""
    mem = core.memory
    if mem is None:
        return {}
    return {
        "prompts_skipped": mem.skipped_draws,
        "prompts_settled": sorted(mem.settled_set),
    }
