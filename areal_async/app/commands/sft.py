"""``areal-async sft``: supervised fine-tuning of the policy on (prompt, answer) pairs, one process.

    config ──> policy + tokenizer (load_policy) ──> problems with an 'answer' ──> train / held-out split
           ──> evaluate (before) ──> sft.steps packed steps ──> RUN_DIR/model ──> evaluate (after)

Outputs in RUN_DIR:
    config.yaml      the resolved config
    metrics.jsonl    one object per step: step, loss, n_tokens, grad_norm, lr, wall_s, elapsed_s
    checkpoints/     atomic step_<k> checkpoints every sft.save_freq_steps (when > 0)
    model/           the final model (HF safetensors) and tokenizer: AutoModelForCausalLM.from_pretrained
    summary.json     data counts, first/final loss, timings, accuracy before/after per split

The loss is ``sft_step``'s: NLL of the answer tokens only (+ eos), token-level mean over the whole
batch, micro-batches packed under ``actor.mb_spec.max_tokens_per_mb``. Evaluation samples with the
embedded ``TorchEngine`` (``evaluator.*``: greedy by default) and scores with ``reward.fn`` in a
``RewardPool`` (killable, so a pathological answer times out instead of hanging the run).

``sft(cfg, run_dir)`` does the job and returns the trained model with the summary (tests use it);
``run_sft`` is the CLI's wrapper around it. Bad input (no answers, a held-out split that leaves
nothing to train, sequences longer than the model or the micro-batch budget, a missing model or
dataset path) raises ``SFTInputError`` before anything trains; ``run_sft`` prints it and returns 2.

Resuming (``recover.mode=auto`` or ``resume``, same command and run dir): training continues from
the newest complete SFT checkpoint with its weights, optimizer, lr schedule and RNG states, the
batch stream fast-forwarded to the same place, and metrics rows written after that checkpoint
replaced; the result equals an uninterrupted run's. The "before" accuracy is the one the first
attempt saved (``eval_before.json``). ``resume`` without a checkpoint is an error; ``auto``
without one starts afresh.

Prompts go through ``train_dataset.template`` (none | chat | r1) like RL's and eval's.
Not covered: multi-GPU / sharded training.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from areal_async.app.workers.evaluate import Sampling, sample_completions, torch_eval_engine
from areal_async.base.private import private_dir
from areal_async.base.process import setup_torch_process
from areal_async.config import ExperimentConfig, to_yaml
from areal_async.data.prompts import Problem, prompt_encoder, sft_examples, training_problems
from areal_async.models.tiny import load_model, load_policy, save_policy
from areal_async.reward.pool import RewardPool
from areal_async.trainer.persist.checkpoint import load_checkpoint, restore_rng_states, save_checkpoint
from areal_async.trainer.persist.checkpoint_dirs import checkpoint_to_resume, prune
from areal_async.trainer.compute.optim import build_lr_scheduler, build_optimizer
from areal_async.trainer.sft import Example, sft_step

__all__ = ["run_sft", "sft", "SFTInputError", "SFTResult", "prepare_data", "train", "evaluate", "sft_total_steps"]


@dataclass
class SFTData:
    """Tokenized training examples and the problems each evaluation split uses."""

    train: list[Example]
    splits: dict[str, list[Problem]]  # "train" (and "heldout") problems to evaluate
    n_problems: int  # problems in the dataset
    n_too_long: int  # dropped: prompt longer than train_dataset.max_prompt_len


class SFTInputError(ValueError):
    """The config's inputs cannot be trained on (data, paths, lengths); the message says why."""


@dataclass
class SFTResult:
    model: torch.nn.Module  # the trained model, as saved to RUN_DIR/model
    tokenizer: object
    summary: dict  # what RUN_DIR/summary.json holds


def run_sft(cfg: ExperimentConfig, run_dir: Path) -> int:
    """``areal-async sft``: 0 on success, 2 when the inputs are unusable (message on stderr)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with our summary line
    try:
        result = sft(cfg, Path(run_dir))
    except SFTInputError as e:
        print(f"areal-async sft: error: {e}", file=sys.stderr)
        return 2
    _print_summary(result.summary, Path(run_dir))
    return 0


def sft(cfg: ExperimentConfig, run_dir: Path) -> SFTResult:
    """Check inputs, evaluate, train, save, evaluate; ``SFTInputError`` before anything trains."""
    t0 = time.perf_counter()
    try:
        model, tok, data = _prepare(cfg)
        ckpt = _resume_point(cfg, run_dir)
        pool = RewardPool.from_config(cfg.reward) if cfg.evaluator.enabled else None
    except (ValueError, OSError) as e:  # OSError: missing model / dataset / tokenizer files
        raise SFTInputError(str(e)) from e
    try:
        model, summary = _train_and_evaluate(cfg, run_dir, model, tok, data, pool, ckpt)
    finally:
        if pool is not None:
            pool.close()
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    _write_json(run_dir / "summary.json", summary)
    return SFTResult(model, tok, summary)


def _prepare(cfg: ExperimentConfig):
    """Policy, tokenizer and data, every input checked before any training starts."""
    setup_torch_process(cfg.cluster)
    torch.manual_seed(cfg.seed)
    model, tok = load_policy(cfg.model, cfg.seed)
    data = prepare_data(cfg, tok)
    _check_lengths(cfg, data, model.config.max_position_embeddings, tok)
    return model.to(cfg.cluster.device), tok, data


def _resume_point(cfg: ExperimentConfig, run_dir: Path) -> dict | None:
    """The newest complete SFT checkpoint per ``recover.mode`` (loaded), or None to start afresh."""
    latest = checkpoint_to_resume(run_dir / "checkpoints", cfg.recover.mode)
    if latest is None:
        return None
    ckpt = load_checkpoint(latest)
    if ckpt["extra"].get("kind") != "sft":
        raise ValueError(
            f"{latest} is not an SFT checkpoint (kind {ckpt['extra'].get('kind')!r}); "
            "an SFT run resumes only from its own checkpoints"
        )
    return ckpt


def _train_and_evaluate(
    cfg: ExperimentConfig, run_dir: Path, model, tok, data: SFTData, pool, ckpt: dict | None = None
) -> tuple[torch.nn.Module, dict]:
    """(the trained model, the summary); when resuming, the model is the checkpoint's, trained on."""
    private_dir(run_dir)  # 0700: its checkpoints are unpickled on resume (base/private.py)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    saved_before = run_dir / "eval_before.json"
    if ckpt is not None and saved_before.exists():
        before = json.loads(saved_before.read_text())
    else:
        before = _evaluate_splits(cfg, model, tok, data, pool)  # the initial model, also when resuming
        _write_json(saved_before, before)
    if ckpt is not None:
        model = load_model(ckpt["path"], cfg.model.dtype).to(cfg.cluster.device)
        print(f"[areal-async sft] resuming from {ckpt['path']} (step {ckpt['step']})", flush=True)
    t_train = time.perf_counter()
    rows = train(cfg, model, tok, data.train, run_dir, ckpt)
    train_wall_s = time.perf_counter() - t_train
    save_policy(model, tok, run_dir / "model")
    after = _evaluate_splits(cfg, model, tok, data, pool)
    summary = _summary(cfg, data, rows, train_wall_s, before, after, run_dir)
    summary["resumed_from_step"] = ckpt["step"] if ckpt is not None else None
    return model, summary


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def prepare_data(cfg: ExperimentConfig, tok) -> SFTData:
    """Problems -> (prompt_ids, answer_ids + eos); the last ``sft.holdout`` problems are held out.

    Prompts longer than ``train_dataset.max_prompt_len`` tokens are dropped (the seed's filter);
    a dataset without any 'answer' is an error, problems without one are kept for evaluation only.
    """
    everything, train_idx = training_problems(cfg.train_dataset, cfg.seed)  # train_dataset.holdout stays out
    problems = [everything[i] for i in train_idx]
    _require_answers(cfg, problems)
    d, enc = cfg.train_dataset, prompt_encoder(tok, cfg.train_dataset.template)
    kept = [p for p in problems if len(enc(p.prompt)) <= d.max_prompt_len]
    train_p, held_p = _split(cfg, kept)
    train = sft_examples(train_p, tok, d.template)
    if not train:
        raise ValueError(
            f"no training examples left: {len(problems)} problems, {len(kept)} within "
            f"train_dataset.max_prompt_len={cfg.train_dataset.max_prompt_len}, "
            f"sft.holdout={cfg.sft.holdout}; expected at least one with an 'answer'"
        )
    splits = {"train": _first(train_p, cfg.evaluator.max_problems)}
    if held_p:
        splits["heldout"] = _first(held_p, cfg.evaluator.max_problems)
    return SFTData(train, splits, len(problems), len(problems) - len(kept))


def _require_answers(cfg: ExperimentConfig, problems: Sequence[Problem]) -> None:
    if not any(p.answer for p in problems):
        where = cfg.train_dataset.path or cfg.train_dataset.type
        raise ValueError(
            f"train_dataset {where!r}: none of its {len(problems)} problems has an 'answer' field; "
            "SFT needs jsonl lines like "
            '{"prompt": ..., "solutions": [...], "answer": <target completion>}'
        )


def _split(cfg: ExperimentConfig, problems: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    k = cfg.sft.holdout
    if k >= len(problems):
        raise ValueError(f"sft.holdout={k}: expected fewer than the {len(problems)} usable problems")
    return (problems[: len(problems) - k], problems[len(problems) - k :]) if k else (problems, [])


def _first(problems: list[Problem], limit: int) -> list[Problem]:
    return problems[:limit] if limit else problems


def _eval_max_new_tokens(cfg: ExperimentConfig) -> int:
    return cfg.evaluator.max_new_tokens or cfg.gconfig.max_new_tokens


def _check_lengths(cfg: ExperimentConfig, data: SFTData, max_positions: int, tok) -> None:
    """Every training sequence fits the model (and the micro-batch budget unless oversize is own_mb);
    every evaluated prompt + evaluator max_new_tokens fits the model."""
    longest = max(len(ex[0]) + len(ex[1]) for ex in data.train)
    if longest > max_positions:
        raise ValueError(
            f"a training sequence has {longest} tokens (prompt + answer + eos): expected <= the "
            f"model's max_position_embeddings={max_positions}"
        )
    mb = cfg.actor.mb_spec
    if mb.oversize == "error" and longest > mb.max_tokens_per_mb:
        raise ValueError(
            f"a training sequence has {longest} tokens: expected <= actor.mb_spec.max_tokens_per_mb="
            f"{mb.max_tokens_per_mb} (or actor.mb_spec.oversize=own_mb)"
        )
    if cfg.evaluator.enabled:
        _check_eval_lengths(cfg, data, max_positions, tok)


def _check_eval_lengths(cfg: ExperimentConfig, data: SFTData, max_positions: int, tok) -> None:
    enc, new = prompt_encoder(tok, cfg.train_dataset.template), _eval_max_new_tokens(cfg)
    longest = max((len(enc(p.prompt)) for probs in data.splits.values() for p in probs), default=0)
    if longest + new > max_positions:
        raise ValueError(
            f"evaluation needs prompt ({longest}) + max_new_tokens ({new}) = {longest + new} positions: "
            f"expected <= the model's max_position_embeddings={max_positions} "
            "(lower evaluator.max_new_tokens or gconfig.max_new_tokens)"
        )


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


def sft_total_steps(cfg: ExperimentConfig, n_examples: int) -> int:
    """``sft.steps``, or ceil(epochs * examples / batch_size) when it is 0."""
    return cfg.sft.steps or max(1, math.ceil(cfg.sft.epochs * n_examples / cfg.sft.batch_size))


def batches(examples: Sequence[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Endless seeded epochs over ``examples`` cut into batches (a batch may span two epochs)."""
    rng, order = random.Random(seed), []
    while True:
        while len(order) < batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        yield [examples[i] for i in order[:batch_size]]
        order = order[batch_size:]


def train(
    cfg: ExperimentConfig, model, tok, examples: list[Example], run_dir: Path, ckpt: dict | None = None
) -> list[dict]:
    """The SFT loop; appends one metrics row per step to RUN_DIR/metrics.jsonl and returns the rows
    (all of the run's, earlier attempts' included, when resuming from ``ckpt``)."""
    total, oc = sft_total_steps(cfg, len(examples)), cfg.sft.optimizer
    opt = build_optimizer(model.parameters(), oc)
    sched = build_lr_scheduler(opt, total, oc)
    stream, rows, t0 = batches(examples, cfg.sft.batch_size, cfg.seed), [], time.perf_counter()
    start = 1
    if ckpt is not None:
        opt.load_state_dict(ckpt["actor_state"]["optimizer"])
        sched.load_state_dict(ckpt["actor_state"]["lr_scheduler"])
        start = ckpt["step"] + 1
        for _ in range(ckpt["step"]):  # the batches the checkpointed steps consumed
            next(stream)
        rows = [r for r in _read_rows(run_dir / "metrics.jsonl") if r["step"] < start]  # later rows: rolled back
        restore_rng_states(ckpt["rng"])
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for step in range(start, total + 1):
            row = _step(cfg, model, opt, next(stream), step, t0)
            sched.step()
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            _maybe_checkpoint(cfg, run_dir, step, model, tok, opt, sched)
    return rows


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _step(cfg: ExperimentConfig, model, opt, batch: list[Example], step: int, t0: float) -> dict:
    lr, t = opt.param_groups[0]["lr"], time.perf_counter()
    mb = cfg.actor.mb_spec
    m = sft_step(
        model, opt, batch, mb.max_tokens_per_mb, grad_clip=cfg.sft.optimizer.gradient_clipping, oversize=mb.oversize
    )
    now = time.perf_counter()
    return {
        "step": step,
        "loss": m["loss"],
        "n_tokens": int(m["n_tokens"]),
        "grad_norm": m["grad_norm"],
        "lr": lr,
        "wall_s": round(now - t, 4),
        "elapsed_s": round(now - t0, 3),
    }


def _maybe_checkpoint(cfg: ExperimentConfig, run_dir: Path, step: int, model, tok, opt, sched) -> None:
    freq = cfg.sft.save_freq_steps
    if not freq or step % freq:
        return
    root = run_dir / "checkpoints"
    state = {"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(), "step": step}
    save_checkpoint(root, step, step, model, tok, state, {"kind": "sft", "step": step})
    prune(root, cfg.saver.keep_last)


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------


def _evaluate_splits(cfg: ExperimentConfig, model, tok, data: SFTData, pool) -> dict:
    if pool is None:
        return {}
    return {name: evaluate(cfg, model, tok, problems, pool) for name, problems in data.splits.items()}


def evaluate(cfg: ExperimentConfig, model, tok, problems: Sequence[Problem], pool) -> dict:
    """Mean reward over ``evaluator.n_samples`` samples of each problem (pass@1; greedy by default)."""
    completions = generate(cfg, model, tok, problems)
    items = [(c, list(p.solutions)) for p, cs in zip(problems, completions) for c in cs]
    scores = [o.score for o in asyncio.run(pool.score_many(items))]
    return {
        "accuracy": sum(scores) / len(scores),
        "n_problems": len(problems),
        "n_samples": len(scores),
        "examples": [{"prompt": p.prompt, "completion": cs[0]} for p, cs in zip(problems[:3], completions)],
    }


def generate(cfg: ExperimentConfig, model, tok, problems: Sequence[Problem]) -> list[list[str]]:
    """Decoded completions, ``evaluator.n_samples`` per problem, in problem order (as ``areal-async eval``)."""
    enc = prompt_encoder(tok, cfg.train_dataset.template)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    return sample_completions(
        torch_eval_engine(cfg, model, tok), decode, [enc(p.prompt) for p in problems], Sampling.from_config(cfg)
    )


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------


def _summary(
    cfg, data: SFTData, rows: list[dict], train_wall_s: float, before: dict, after: dict, run_dir: Path
) -> dict:
    return {
        "experiment_name": cfg.experiment_name,
        "steps": len(rows),
        "n_problems": data.n_problems,
        "n_train_examples": len(data.train),
        "n_dropped_long_prompts": data.n_too_long,
        "eval_problems": {k: len(v) for k, v in data.splits.items()},
        "first_loss": rows[0]["loss"],
        "final_loss": rows[-1]["loss"],
        "train_tokens": sum(r["n_tokens"] for r in rows),
        "train_wall_s": round(train_wall_s, 3),
        "eval": {"before": before, "after": after},
        "model_dir": str(run_dir / "model"),
    }


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def _print_summary(s: dict, run_dir: Path) -> None:
    acc = lambda side: ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in s["eval"][side].items()) or "-"  # noqa: E731
    print(
        f"sft: {s['steps']} steps on {s['n_train_examples']} examples in {s['train_wall_s']:.1f}s "
        f"(total {s['wall_s']:.1f}s); loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}; "
        f"accuracy before: {acc('before')}; after: {acc('after')}; model: {run_dir / 'model'}"
    )
