"""The scheduler worker, built from the run directory."""

from __future__ import annotations

from pathlib import Path

from areal_async.app.workers.wiring import load_run, supervisor_t0
from areal_async.base.runkeys import Roster
from areal_async.data.prompts import prompt_encoder
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.scheduler.service import SchedulerService


def build_scheduler(run_dir: str | Path) -> SchedulerService:
    cfg, ep = load_run(run_dir)
    encode = prompt_encoder(policy_tokenizer(cfg.model), cfg.train_dataset.template)
    return SchedulerService(cfg, ep, run_dir, supervisor_t0(), encode, roster=Roster.of_run(run_dir))
