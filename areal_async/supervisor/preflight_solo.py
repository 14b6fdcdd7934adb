"""Preflight checks of the recording (``rollout.dump_tensors``) and of one role at a time (``mode``).

- ``rollout.dump_tensors``: the recording's size, an upper bound per step and for the run (prompts up
  to ``train_dataset.max_prompt_len`` tokens, outputs up to ``gconfig.max_new_tokens``, the wire's int32
  ids and versions and float32 logprobs), against the free disk; the CLI prints it when the run starts.
- ``mode=train_only``: ``solo.recording`` is a run directory with a recording header and steps.
- ``mode=rollout_only`` with ``solo.weights``: a run directory with complete checkpoints.

Torch-free (the CLI's preflight runs in the supervisor's process).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from areal_async.base.records import RECORDING_DIR, RECORDING_HEADER, recorded_steps
from areal_async.data.templates import render_prompt_ids
from areal_async.supervisor.preflight_findings import Context, Finding, error, ok, size_text as _size, warn
from areal_async.trainer.persist.checkpoint_dirs import COMPLETE

RNG_STATE_BYTES = 5056  # torch.get_rng_state() of the CPU generator (Mersenne twister)
PER_SEQ_BYTES = 8 + 60  # its score; its id and output length in the metadata (JSON)
PER_GROUP_BYTES = 60  # its id, size and prompt length in the metadata


def step_bytes_bound(n_groups: int, n_samples: int, prompt_tokens: int, output_tokens: int, with_mask: bool) -> int:
    """About one step's file (``trainer/persist/recording.py``: the wire's layout, each group's prompt once) when every
    prompt has ``prompt_tokens`` and every output ``output_tokens``."""
    per_token = 4 + 4 + 4 + (1 if with_mask else 0)  # id, logprob, version (+ loss mask)
    per_group = 4 * prompt_tokens + PER_GROUP_BYTES + n_samples * (per_token * output_tokens + PER_SEQ_BYTES)
    return n_groups * per_group + RNG_STATE_BYTES + 1024


def _prompt_tokens(ctx: Context) -> tuple[int, int]:
    """(the first prompt's tokens after the template when the checks before could render it, else the bound;
    the bound: train_dataset.max_prompt_len, or fewer where the built model's positions end first)."""
    cfg = ctx.cfg
    bound = cfg.train_dataset.max_prompt_len
    if not cfg.model.path:
        bound = min(bound, cfg.model.max_position_embeddings - cfg.gconfig.max_new_tokens)
    try:
        first = len(render_prompt_ids(ctx.tokenizer, ctx.first_prompt, cfg.train_dataset.template))
    except Exception:  # no tokenizer or prompt (an earlier check failed and said why), a template that fails
        first = bound
    return min(first, bound), bound


def check_recording(ctx: Context) -> list[Finding]:
    cfg = ctx.cfg
    if not cfg.rollout.dump_tensors or cfg.mode == "train_only":
        return []
    groups, n, new = cfg.train_dataset.batch_size, cfg.gconfig.n_samples, cfg.gconfig.max_new_tokens
    first, bound = _prompt_tokens(ctx)
    mask, n_seqs = cfg.rollout.episodic, groups * n
    per, most = step_bytes_bound(groups, n, first, new, mask), step_bytes_bound(groups, n, bound, new, mask)
    parent = ctx.run_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    free, need = shutil.disk_usage(parent).free, most * cfg.total_train_steps
    what = (
        f"records about {_size(per)} per step ({n_seqs} sequences of {first} prompt + <= {new} new tokens), "
        f"{_size(per * cfg.total_train_steps)} for {cfg.total_train_steps} steps (at most {_size(need)}: prompts of "
        f"{bound} tokens) in {ctx.run_dir / RECORDING_DIR}; {_size(free)} free"
    )
    if need > free:
        return [error("rollout.dump_tensors", True, what, "free disk space, or record a shorter run")]
    if need > free / 2:
        return [warn("rollout.dump_tensors", True, what, "watch the disk")]
    return [ok("rollout.dump_tensors", True, what)]


def check_solo(ctx: Context) -> list[Finding]:
    cfg = ctx.cfg
    if cfg.mode == "train_only":
        return _check_recording_source(cfg.solo.recording, cfg.total_train_steps)
    if cfg.mode == "rollout_only" and cfg.solo.weights:
        return _check_weights_source(cfg.solo.weights)
    return []


def _check_recording_source(src: str, total: int) -> list[Finding]:
    header, steps = Path(src) / RECORDING_DIR / RECORDING_HEADER, recorded_steps(src)
    try:
        fmt = json.loads(header.read_text()).get("format")
    except (OSError, ValueError, AttributeError) as e:
        todo = "record a run with rollout.dump_tensors=true and point solo.recording at its run directory"
        return [error("solo.recording", src, f"no readable {header} ({type(e).__name__})", todo)]
    if not steps:
        return [error("solo.recording", src, f"{fmt} header but no recorded step", "record at least one step")]
    n = min(total, len(steps))
    return [ok("solo.recording", src, f"{len(steps)} recorded steps ({steps[0]}..{steps[-1]}), {n} to train")]


def _check_weights_source(src: str) -> list[Finding]:
    ckpts = [d for d in Path(src, "checkpoints").glob("step_*") if (d / COMPLETE).is_file()]
    if not ckpts:
        return [
            error(
                "solo.weights",
                src,
                f"no complete checkpoint under {src}/checkpoints",
                "point it at a run saved with saver.freq_steps > 0, or drop it for fixed weights",
            )
        ]
    return [ok("solo.weights", src, f"{len(ckpts)} checkpoints schedule the weights by version")]
