"""What a scheduler starts from: the core over the config's problems, the attempt counter
(``RUN_DIR/resumes.json``), a checkpoint's books (``extra.json``), the run log rolled back to it.

``resumes.json`` also keeps, per start of a scheduler in the run directory (``starts``), what its
books continued from: ``books`` "new" (the first start), "kept" (a rerun without recovery: the books
go on), "cut" (rolled back: to the ``checkpoint`` it resumed from, or to nothing when there was none).
A cut to a checkpoint names what the trainer's checkpoint held: the id prefix its ledger issued under
(``id_prefix``), how many groups it had issued (``groups_issued``: later group numbers of that prefix
were issued after it), its ``next_step`` and the groups then in flight (``in_flight``, aborted and
re-issued now). ``areal-async verify`` reads it to tell a sample that a resume rolled back from one
that was lost."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from areal_async.base.eta import EtaMode
from areal_async.base.manifest import RunManifest
from areal_async.config import ExperimentConfig
from areal_async.data.gym import GymSource
from areal_async.data.prompts import LengthFilter, PromptCursor, keep_short, load_problems, split_holdout
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.group_filter import build_group_filter
from areal_async.scheduler.runlog import RunLog
from areal_async.scheduler.sinks import sinks_from_config
from areal_async.scheduler.task_book import PromptTable, TaskBook

log = logging.getLogger("areal_async.scheduler")


def build_core(
    cfg: ExperimentConfig, tokenize, runlog: RunLog
) -> tuple[SchedulerCore, LengthFilter, Optional[TaskBook]]:
    """The core over the problems within ``train_dataset.max_prompt_len`` (counted and logged here, at start),
    and for a reasoning-gym mixture its per-task books (``task_book.py``)."""
    d = cfg.train_dataset
    source = GymSource.from_config(d, cfg.seed) if d.type == "reasoning_gym" else None
    problems = source.problems() if source is not None else load_problems(d, cfg.seed)
    train, held = split_holdout(problems, d.holdout)  # the held-out problems are never issued
    lengths = keep_short(problems, tokenize, d.max_prompt_len, among=train)
    log.info("train_dataset: %s; %d held out (train_dataset.holdout)", lengths.describe(), len(held))
    kept = [problems[i] for i in lengths.kept]
    book = None if source is None else TaskBook(source, lengths.kept, kept, tokenize, d.max_prompt_len, d.curriculum)
    problem = book.table if book is not None else PromptTable(kept, tokenize, lambda i: 0)
    g = cfg.gconfig
    params = SchedulerParams(
        batch_size=cfg.train_dataset.batch_size,
        n_samples=g.n_samples,
        eta=EtaMode.of(cfg).eta,
        total_steps=cfg.total_train_steps,
        max_concurrent=cfg.rollout.max_concurrent_rollouts,
        gen=dict(
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            greedy=g.greedy,
            stop_token_ids=list(g.stop_token_ids),
        ),
        gen_deadline_s=cfg.rollout.gen_deadline_s,
        reward_deadline_s=cfg.reward.deadline_s,
        max_reissues=cfg.rollout.max_reissues,
        group_filter=build_group_filter(cfg.rollout.dynamic_filter),
        filter_max_gen_batches=cfg.rollout.dynamic_filter_max_gen_batches,
        skip_solved_after=cfg.rollout.skip_solved_after,
        over_provision=cfg.rollout.over_provision,
    )
    cursor = PromptCursor(len(lengths.kept), cfg.seed, d.shuffle)
    return SchedulerCore(params, cursor, problem, log_samples=runlog.samples), lengths, book


def open_books(
    cfg: ExperimentConfig, endpoints: RunManifest, run_dir: Path, tokenize
) -> tuple[RunLog, SchedulerCore, LengthFilter, Optional[TaskBook], Optional[dict]]:
    """(run log, core, prompt filter, task book (a reasoning-gym mixture's) or None, the checkpoint's
    scheduler state or None) of a scheduler starting in
    ``run_dir``: a resumed run (``resume_from``, or recovery on) continues the books from the checkpoint,
    the run log rolled back to it; a restart from nothing gets ids no earlier start issued."""
    resume = endpoints.resume_from
    ckpt_state = checkpoint_state(resume) if resume else None
    cut_books = ckpt_state is not None or cfg.recover.mode != "disabled"
    if cut_books:
        # a resumed run continues the books from the checkpoint (nothing, if there is none)
        cut = RunLog.rollback(run_dir, ckpt_state["offsets"] if ckpt_state else {})
        log.info("resuming from %s; rolled back %s lines written after it", resume, cut)
    runlog = RunLog(run_dir, True, sinks_from_config(cfg, run_dir))
    core, prompts, task_book = build_core(cfg, tokenize, runlog)
    attempt = next_attempt(run_dir)
    if ckpt_state is None and attempt:
        core.restart_ids(attempt)  # a restart from nothing: the books were cut to empty
    if ckpt_state is not None:
        runlog.n_sample_lines = int(ckpt_state["n_sample_lines"])
        recovered = core.restore(ckpt_state, at_least=attempt)
        if task_book is not None:
            task_book.restore(ckpt_state.get("tasks"))
        log.info(
            "restored step %d, version %d; %d in-flight samples aborted and re-issued",
            core.next_step,
            core.version,
            len(recovered),
        )
    # before any id is issued
    save_attempt(run_dir, core.resumes, start_entry(core.resumes, attempt, cut_books, resume, ckpt_state))
    return runlog, core, prompts, task_book, ckpt_state


def next_attempt(run_dir: Path) -> int:
    """How many times a scheduler started in ``run_dir`` before (``RUN_DIR/resumes.json``, 0 when
    none): the id prefix of a resumed or restarted run is at least this, so ids never repeat."""
    path = Path(run_dir) / "resumes.json"
    if not path.exists():
        return 0
    return int(json.loads(path.read_text())["resumes"]) + 1


def start_entry(resumes: int, attempt: int, cut: bool, resume: Optional[str], ckpt: Optional[dict]) -> dict:
    """This start's line in ``resumes.json``'s ``starts`` (the module docstring says what each key means)."""
    books = "cut" if cut else "kept" if attempt else "new"
    entry = {"attempt": resumes, "books": books, "checkpoint": str(resume) if ckpt is not None else None}
    if ckpt is None:
        return entry
    led = ckpt["ledger"]
    open_groups = [g["group_id"] for g in led["groups"] if g["status"] not in ("trained", "aborted")]
    return entry | {
        "id_prefix": led.get("id_prefix", ""),
        "groups_issued": int(led["n_groups_issued"]),
        "next_step": int(ckpt["next_step"]),
        "in_flight": open_groups,
    }


def save_attempt(run_dir: Path, resumes: int, entry: Optional[dict] = None) -> None:
    """``resumes.json``: the attempt counter and, appended, this start's ``entry`` (``start_entry``)."""
    path = Path(run_dir) / "resumes.json"
    starts = json.loads(path.read_text()).get("starts", []) if path.exists() else []
    tmp = Path(run_dir) / "resumes.json.tmp"
    tmp.write_text(json.dumps({"resumes": resumes, "starts": starts + ([entry] if entry else [])}) + "\n")
    tmp.replace(path)


def checkpoint_state(path: str) -> dict:
    state = json.loads((Path(path) / "extra.json").read_text())
    missing = {"version", "next_step", "cursor", "ledger", "offsets", "n_sample_lines"} - set(state)
    if missing:
        raise ValueError(f"checkpoint {path} lacks scheduler state {sorted(missing)}")
    return state
