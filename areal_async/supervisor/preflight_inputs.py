"""Preflight checks of what a run reads from outside its YAML: the model directory and its tokenizer,
the dataset files, the prompt template on a first prompt, and the plug-ins.

Nothing here downloads: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are set and every load is
``local_files_only``; a model path that is not a local directory is refused before transformers
sees it. The plug-ins are imported and inspected (``base.plugins.contract_problem``, the static
half of ``areal-async check-plugin``), not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from areal_async.base.plugins import contract_problem
from areal_async.data.problem import with_instruction
from areal_async.data.prompts import read_jsonl_head, tiny_arith
from areal_async.data.templates import render_prompt_ids
from areal_async.rollout.engines.kv_budget import MIB, KVBudget, bytes_per_position
from areal_async.rollout.engines.kv_budget import TODO as KV_TODO
from areal_async.supervisor.preflight_findings import Context, Finding, error, first_line, ok, warn
from areal_async.supervisor.preflight_gym import check_gym_dataset, check_vocabulary

OFFLINE = "nothing is downloaded: no network is attempted"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
JSONL_LINE = '{"prompt": str, "solutions": [str, ...]}'


# ---- the model ---------------------------------------------------------------------------------


def check_model_files(ctx: Context) -> list[Finding]:
    """Cheap first: model.path (and a loaded ref.path) are directories holding a config.json."""
    out = []
    if ctx.cfg.model.path:
        out.append(model_files("model.path", ctx.cfg.model.path))
    if ctx.cfg.actor.kl_ctl > 0 and ctx.cfg.ref.path:
        out.append(model_files("ref.path", ctx.cfg.ref.path))
    return [f for f in out if f is not None]


def check_model(ctx: Context) -> list[Finding]:
    """The policy's config and tokenizer load (the reference model's config too, when it is loaded)."""
    from areal_async.models.policy_tokenizer import policy_tokenizer  # transformers: after the cheap checks

    m = ctx.cfg.model
    if not m.path:
        ctx.tokenizer = policy_tokenizer(m)
        shape = f"h={m.hidden_size}, {m.num_hidden_layers} layers, {m.max_position_embeddings} positions"
        kind = "the character tokenizer" if m.tokenizer == "char" else f"a local BPE of {len(ctx.tokenizer)} tokens"
        return [ok("model.path", None, f"a {m.arch} built locally ({shape}) with {kind}")]
    found = model_config("model.path", m.path) or _tokenizer(ctx, m.path)
    if found:
        return [found]
    out = [ok("model.path", m.path, f"config and {type(ctx.tokenizer).__name__} load from the local directory")]
    if ctx.cfg.actor.kl_ctl > 0 and ctx.cfg.ref.path:
        out.append(model_config("ref.path", ctx.cfg.ref.path) or ok("ref.path", ctx.cfg.ref.path, "its config loads"))
    return out


def check_lora(ctx: Context) -> list[Finding]:
    """``actor.lora``: peft is installed, and every target names linear layers of the policy (its
    module tree built on the meta device: no weights read or allocated)."""
    spec = ctx.cfg.actor.lora
    if spec.rank == 0:
        return []
    from areal_async.models import lora  # torch: after the cheap checks

    if importlib.util.find_spec("peft") is None:
        return [
            error(
                "actor.lora.rank", spec.rank, "LoRA needs the peft package, which is not installed", lora.PEFT_INSTALL
            )
        ]
    try:
        lora.target_linears(_meta_policy(ctx.cfg.model), spec.target_modules)
    except ValueError as e:
        todo = "name the last part of linear layers' module names (q_proj, down_proj ...)"
        return [error("actor.lora.target_modules", spec.target_modules, str(e), todo)]
    return [ok("actor.lora.rank", spec.rank, f"an adapter on {', '.join(spec.target_modules)}")]


def _meta_policy(m):
    """The policy's module tree on the meta device (the built tiny model, or model.path's config); the
    vocabulary size is irrelevant to the layers an adapter may target (the lm head is never one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal_async.models.tiny import hf_config

    config = AutoConfig.from_pretrained(m.path, local_files_only=True) if m.path else hf_config(m, 64)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _tokenizer(ctx: Context, path: str) -> Finding | None:
    from areal_async.models.tokenizer import load_tokenizer

    try:
        ctx.tokenizer = load_tokenizer(path)
    except Exception as e:  # any failure of a local load: the message says which
        what = f"its tokenizer does not load ({first_line(e)}; {OFFLINE})"
        return error("model.path", path, what, "point model.path at an HF model directory with its tokenizer files", e)
    return None


def _todo(key: str) -> str:
    return f"point {key} at a local HF model directory (config.json + tokenizer files)"


def model_files(key: str, path: str) -> Finding | None:
    """An error when ``path`` is not a directory holding a config.json that parses; None when it is."""
    p = Path(path)
    if not p.exists():
        return error(key, path, f"no such directory ({OFFLINE})", _todo(key))
    if not p.is_dir():
        return error(key, path, f"is a file, not a model directory ({OFFLINE})", _todo(key))
    if not (p / "config.json").is_file():
        return error(key, path, f"the directory holds no config.json ({OFFLINE})", _todo(key))
    try:
        json.loads((p / "config.json").read_text())
    except (ValueError, OSError) as e:
        return error(key, path, f"its config.json is not JSON ({first_line(e)})", _todo(key), e)
    return None


def model_config(key: str, path: str) -> Finding | None:
    """An error when transformers cannot load the directory's config (locally); None when it can."""
    try:
        with _offline():
            from transformers import AutoConfig  # imports torch: only for a directory that may hold a model

            AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # an unknown model_type, a missing field ...
        return error(key, path, f"its config.json does not load ({first_line(e)}; {OFFLINE})", _todo(key), e)
    return None


@contextmanager
def _offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` for the load inside, restored after: the supervisor's
    environment is what its workers inherit, and one the fork server (started before the preflight) did not
    see would make every worker start from a fresh interpreter instead of a fork."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys if saved[k] is None})
    try:
        yield
    finally:
        for k in keys:
            if saved[k] is None:
                os.environ.pop(k, None)


# ---- the data ----------------------------------------------------------------------------------


def check_dataset(ctx: Context) -> list[Finding]:
    d = ctx.cfg.train_dataset
    if d.type == "reasoning_gym":
        return check_gym_dataset(ctx)
    if d.type == "tiny_arith":
        problems = tiny_arith(d, ctx.cfg.seed)
        ctx.first_prompt = with_instruction(problems[0], d.instruction).prompt
        out = [ok("train_dataset.type", d.type, f"{len(problems)} problems generated locally")]
        if len(problems) < d.size:
            out.append(
                warn(
                    "train_dataset.size",
                    d.size,
                    f"only {len(problems)} distinct problems exist for max_operand={d.max_operand}, ops={d.ops!r}",
                    f"expect {len(problems)}",
                )
            )
        return out
    found = jsonl_file("train_dataset.path", d.path, need_answer=ctx.cmd == "sft")
    if found.level == "ok":
        ctx.first_prompt = with_instruction(read_jsonl_head(d.path, 1)[0][1], d.instruction).prompt
    return [found]


def check_eval_data(ctx: Context) -> list[Finding]:
    path = ctx.cfg.evaluator.path
    return [jsonl_file("evaluator.path", path)] if path else []


def jsonl_file(key: str, path: str, need_answer: bool = False, n: int = 5) -> Finding:
    """The file exists and its first ``n`` problems parse (and carry an 'answer' when SFT needs one)."""
    todo = f"point {key} at a training-format jsonl, one {JSONL_LINE} per line"
    p = Path(path)
    if not p.is_file():
        return error(key, path, "no such file" if not p.exists() else "not a regular file", todo)
    try:
        head = read_jsonl_head(p, n)
    except (ValueError, OSError) as e:
        return error(key, path, str(e), f"fix the file there, or {todo}", e)
    if need_answer:
        lacking = [lineno for lineno, prob in head if not prob.answer]
        if lacking:
            return error(
                key,
                path,
                f"{path}:{lacking[0]}: no 'answer' (the SFT target completion)",
                f'SFT lines need {JSONL_LINE[:-1]}, "answer": str}}',
            )
    return ok(key, path, f"the first {len(head)} line(s) parse ({', '.join(sorted(_fields(head)))})")


def _fields(head) -> set[str]:
    return {"prompt", "solutions"} | ({"answer"} if any(p.answer for _, p in head) else set())


def check_template(ctx: Context) -> list[Finding]:
    """The template renders the first prompt with the run's tokenizer (needs both checks above)."""
    d = ctx.cfg.train_dataset
    if ctx.tokenizer is None or ctx.first_prompt is None:
        return []
    try:
        ids = render_prompt_ids(ctx.tokenizer, ctx.first_prompt, d.template)
    except Exception as e:  # a chat template that does not render, a tokenizer without one
        return [
            error(
                "train_dataset.template",
                d.template,
                f"does not render the first prompt ({first_line(e)})",
                "use train_dataset.template=none, or a tokenizer with a chat template",
                e,
            )
        ]
    out = [
        ok(
            "train_dataset.template",
            d.template,
            f"renders the first prompt {ctx.first_prompt[:30]!r} to {len(ids)} tokens",
        )
    ]
    if len(ids) > d.max_prompt_len:
        out.append(
            warn(
                "train_dataset.max_prompt_len",
                d.max_prompt_len,
                f"the first prompt is {len(ids)} tokens after the template: such prompts are filtered out",
                "raise it if they should train",
            )
        )
    return out + _positions(ctx, len(ids)) + _kv_cache(ctx) + _vocabulary(ctx)


def _vocabulary(ctx: Context) -> list[Finding]:
    return check_vocabulary(ctx) if ctx.texts else []


def _positions(ctx: Context, prompt_len: int) -> list[Finding]:
    """A warning when the first prompt + gconfig.max_new_tokens outruns the model's positions."""
    m, new = ctx.cfg.model, ctx.cfg.gconfig.max_new_tokens
    limit = m.max_position_embeddings
    if m.path:
        limit = json.loads((Path(m.path) / "config.json").read_text()).get("max_position_embeddings") or 0
    if not limit or prompt_len + new <= limit:
        return []
    what = (
        f"the first prompt ({prompt_len} tokens) + {new} new tokens = {prompt_len + new} positions, more than the "
        f"model's max_position_embeddings={limit}"
    )
    return [warn("gconfig.max_new_tokens", new, what, "lower it, or use a model with a longer context")]


def _kv_cache(ctx: Context) -> list[Finding]:
    """An error when the longest admitted request (train_dataset.max_prompt_len + gconfig.max_new_tokens,
    gconfig.n_samples samples) cannot fit rollout.kv_cache_mb: the engine would refuse every such group."""
    c = ctx.cfg
    if not c.rollout.kv_cache_mb or not c.rollout.backend.startswith("torch"):
        return []
    m = c.model
    shape = SimpleNamespace(**json.loads((Path(m.path) / "config.json").read_text())) if m.path else m
    budget = KVBudget(bytes_per_position(shape, DTYPE_BYTES[m.dtype]), int(c.rollout.kv_cache_mb * MIB))
    d, g = c.train_dataset, c.gconfig
    problem = budget.refusal(d.max_prompt_len, g.n_samples, g.max_new_tokens)
    what = f"the longest request (train_dataset.max_prompt_len={d.max_prompt_len}): {problem}"
    return [error("rollout.kv_cache_mb", c.rollout.kv_cache_mb, what, KV_TODO)] if problem else []


# ---- plug-ins ----------------------------------------------------------------------------------


def check_plugins(ctx: Context) -> list[Finding]:
    """reward.fn, rollout.workflow, rollout.agent and a plug-in rollout.dynamic_filter import and have the right
    signature (nothing is run)."""
    _on_workers_path()
    cfg, out = ctx.cfg, []
    dyn = cfg.rollout.dynamic_filter if ":" in cfg.rollout.dynamic_filter else ""  # '' or a built-in: no plug-in
    if cfg.reward.judge:
        out.append(_judge_finding(cfg.reward.judge))
    for key, path, kind in (
        ("reward.fn", "" if cfg.reward.judge else cfg.reward.fn, "reward"),
        ("rollout.workflow", cfg.rollout.workflow, "workflow"),
        ("rollout.agent", cfg.rollout.agent, "agent"),
        ("rollout.dynamic_filter", dyn, "dynamic_filter"),
    ):
        if not path:
            continue
        _, problem = contract_problem(path, kind)  # the problem says what was expected
        if problem is None:
            out.append(ok(key, path, f"imports and has the {kind} signature"))
            continue
        fix = "fix the dotted path 'module:name' (it must import from here and PYTHONPATH)"
        todo = fix if problem.startswith("cannot load") else f"fix the {kind} plug-in"
        out.append(error(key, path, problem, f"{todo}; check it with `areal-async check-plugin {path}`"))
    return out


def _judge_finding(path: str) -> Finding:
    """reward.judge: a local HF model directory (its model is loaded by each reward process, not here)."""
    d = Path(path)
    missing = [f for f in ("config.json", "tokenizer_config.json") if not (d / f).is_file()]
    if not missing:
        return ok("reward.judge", path, "a model directory: each reward process loads it once (reward/judge.py)")
    what = f"not a model directory: {', '.join(missing)} missing"
    return error("reward.judge", path, what, "give a local HF model directory or gguf:SOURCE")


def _on_workers_path() -> None:
    """The workers run ``python -m workers.<role>`` from this directory: it is on their sys.path."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
