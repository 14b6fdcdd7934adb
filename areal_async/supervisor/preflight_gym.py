"""The preflight of ``train_dataset.type: reasoning_gym``: the extra is installed, every task is one
reasoning-gym knows, and every level of every task makes a problem whose entry the reward can carry.

Each error is one line naming the key (``train_dataset.tasks[1].name='nope': ...``). The config
load has already checked the shape of ``tasks`` (weights > 0, mappings; ``config/gym_tasks.py``).
Hands the first prompt and, per task, a few prompts and answers to the template check, which looks
for characters the tokenizer cannot say (``check_vocabulary``).
"""

from __future__ import annotations

import difflib

from areal_async.config.gym_tasks import GymTask, parse_tasks
from areal_async.data.gym import GYM_INSTALL, GymSource, require_gym
from areal_async.data.gym_entry import GYM_REWARD_FN, GYM_REWARD_FNS, encode_entry
from areal_async.supervisor.preflight_findings import Context, Finding, error, first_line, ok, warn

N_SAMPLES = 8  # problems per task looked at for the tokenizer's alphabet


def check_gym_dataset(ctx: Context) -> list[Finding]:
    d = ctx.cfg.train_dataset
    try:
        rg = require_gym()
    except ImportError as e:
        return [error("train_dataset.type", d.type, "the reasoning-gym package is not installed", GYM_INSTALL, e)]
    tasks = parse_tasks(d.tasks)
    for i, task in enumerate(tasks):
        bad = _task_problem(rg, i, task)
        if bad is not None:
            return [bad]
    source = GymSource(tasks, d.size, ctx.cfg.seed)
    ctx.first_prompt = source.problem(0).prompt
    ctx.texts = _texts(rg, source)
    shares = ", ".join(f"{t.name} {n}" for t, n in zip(tasks, source.counts))
    out = [ok("train_dataset.tasks", [t.name for t in tasks], f"{d.size} problems: {shares}")]
    if ctx.cfg.reward.fn not in GYM_REWARD_FNS and not ctx.cfg.reward.judge:  # a judge reads the entry's answer
        what = "is not the reasoning-gym scorer: the solutions it gets are reasoning-gym entries (JSON)"
        out.append(warn("reward.fn", ctx.cfg.reward.fn, what, f"set reward.fn={GYM_REWARD_FN} unless yours reads them"))
    return out


def _task_problem(rg, i: int, task: GymTask) -> Finding | None:
    """An error for a task reasoning-gym does not know, or a level whose config it refuses."""
    from reasoning_gym.factory import DATASETS

    if task.name not in DATASETS:
        close = difflib.get_close_matches(task.name, sorted(DATASETS), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"one of reasoning-gym's {len(DATASETS)} tasks"
        return error(f"train_dataset.tasks[{i}].name", task.name, "no such reasoning-gym task", hint)
    for level in range(task.n_levels):
        key = f"train_dataset.tasks[{i}]." + ("config" if level == 0 else f"levels[{level - 1}]")
        try:
            encode_entry(task.name, rg.create_dataset(task.name, **task.config_at(level), seed=0, size=1)[0])
        except Exception as e:  # a field the task's config lacks, a value its validate() refuses ...
            value = task.config if level == 0 else task.levels[level - 1]
            return error(key, value, f"reasoning-gym's {task.name} refuses it ({first_line(e)})", "fix the fields", e)
    return None


def _texts(rg, source: GymSource) -> dict[str, list[str]]:
    """A few prompts and oracle answers of each task (every level), for the tokenizer's alphabet."""
    out: dict[str, list[str]] = {}
    for t, task in enumerate(source.tasks):
        for level in range(task.n_levels):
            ds = source.dataset(t, level)
            for j in range(min(N_SAMPLES, len(ds))):
                out.setdefault(task.name, []).extend([ds[j]["question"], str(ds[j]["answer"])])
    return out


def check_vocabulary(ctx: Context) -> list[Finding]:
    """A warning per task whose prompts or answers hold a character the tokenizer maps to its unknown token."""
    tok, out = ctx.tokenizer, []
    unk = getattr(tok, "unk_token_id", None)
    if tok is None or unk is None:
        return []
    for i, (name, texts) in enumerate(ctx.texts.items()):
        chars = sorted({c for text in texts for c in text})
        missing = "".join(c for c in chars if tok.encode(c, add_special_tokens=False) == [unk])
        if missing:
            what = f"task {name}: characters {missing[:20]!r} are unknown to the tokenizer (they read as its unk token)"
            out.append(warn(f"train_dataset.tasks[{i}].name", name, what, "use a tokenizer that has them"))
    return out
