"""The system's own cost: fleet ms per step against an in-process loop on the same model and data.

    python -m benchmarks.overhead [--json PATH] [--steps N] [--etas 0 1 2] [--model-path DIR]
                                  [--out DIR] [--no-fleet] [--gen-repeats R] [--no-pin] [key=value ...]

One model, dataset and batch, run three ways:

(a) in-process: the project's own ``TorchEngine``, reward function and ``PPOActor`` called in
    one Python loop (no processes, no sockets; torch threads as the fleet's workers): per step
    publish (``engine.update_weights`` with the trainer's tensors), generate the batch, score
    every sample, one ``train_step``. This is the floor the fleet can reach on one core.
    It runs in legs: before the first fleet run and again after each (four legs with η 0 1 2,
    each a fresh loop from the same weights), and each fleet run is divided by the mean of the
    two legs around it; the table's in-process row is the mean of all legs. This machine's speed
    drifts in phases of seconds (the same ``train_step`` at ~35 ms in one, ~50 in the next), and
    with one in-process measurement before every fleet run a ratio hung on which phases the two
    landed in (η = 0, eight runs of one code, half of them with the other roles kept off the
    trainer's CPU: 0.89-1.51x; with legs, fourteen runs: 0.91-1.36x).
(b) the fleet (``areal-async run``) at η = 0, 1, 2 with the same config: one rollout worker,
    one reward worker, the trainer, the scheduler.
(c) the embedded engine's tokens/s against ``transformers`` ``generate`` (KV cache, sampling) on
    the same model and prompts, HF with the engine's shared prompt prefill or with
    ``num_return_sequences``, whichever is faster (``benchmarks.engine_vs_hf.measure``).

Default setup (the issue's small case, built here, nothing downloaded): Llama, hidden 64,
2 layers, a 16-token character vocabulary (digits, '+', '=', 4 specials) saved as an HF
directory and loaded with ``model.path``; a jsonl a+b task (100 problems, exact-match reward);
32 prompts x 8 samples per step, 3 new tokens, lr 1e-3, no SFT warm-up. ``--model-path`` runs
another local HF model instead (its tokenizer must encode the prompts).

Phases per step (ms, means over the steady window after ``--warmup`` steps):
- gen: rollout engine busy time (fleet: the rollout worker's ``busy_s`` heartbeat counter);
- reward: scoring (fleet: wall time the reward worker had a group in its pool);
- train: ``train_step`` incl. the proximal-logprob recompute (fleet: the trainer's ``train_s`` plus
  ``ahead_s``, its first forward run ahead while the rewards were scored, at η = 0);
- publish: weights to the engine (fleet: the trainer's ``publish_s``, until the channel
  released the publisher; the rollout side's load is inside gen). Over shm/zmq the trainer
  publishes after its TrainStepDone, while the scheduler plans (trainer/service.py), so the
  publication overlaps the wait and its wall time includes sharing the CPU with it;
- wait: the trainer idle between two steps (fleet: step - train - publish, which understates
  it by the overlapped parts of publish and ahead; in-process 0);
- step: wall time per step;
- cpu: CPU time per step (in-process: this process; fleet: every process of the run, by role
  in ``cpu_ms_by_role``). On a shared machine wall time follows the CPU share the run gets, so
  the CPU the fleet's plumbing adds per step is the figure that does not depend on the load.
In the fleet the phases of different steps overlap at η > 0, so they need not sum to the step.
Placement: with 2+ CPUs the fleet's trainer is pinned to one CPU and the in-process loop (one
thread) runs on that CPU. At η >= 1 every other role is pinned to the rest (the CPU is the
trainer's own; ``benchmarks.common.fleet.placement``, as in ``benchmarks.async_speedup``): the
trainer is the critical path and, unpinned, loses time slices to decoding, reward checks and
messages. At η = 0 the other roles stay unpinned: the phases run one after another, so they may use
the trainer's CPU while it waits. η = 0 over quiet runs here (one leg, before the forward ahead):
0.89-1.16x in seven of ten runs this way and 1.27-1.35x in three (200 steps: 1.24-1.38x),
1.15-1.25x with the other roles kept off the trainer's CPU, 1.13-1.33x with nothing pinned; with
the forward ahead, four runs each way, 1.08-1.36x and 0.96-1.25x. What moves it most is the
machine: a ``train_step`` that follows ~20 ms of sleep or of other work took 34-48 ms of CPU
instead of 31-33 ms back to back (same process, batch and CPU), and at η = 0 the trainer waits
~17-22 ms before every step, while the in-process loop's generation and scoring take ~13.
``--no-pin`` pins nothing; a ``cluster.cpu_affinity.*`` override replaces the placement in every
run.

JSON rows (``metric``, ``value``, ``unit`` always): ``ms_per_step`` (``mode`` inprocess|fleet,
``eta``, phase ms, ``cpu_ms``; in-process ``legs_ms``), ``fleet_vs_inprocess_ms_per_step_ratio``
(``inprocess_ms``: the legs' mean it divides by, ``eta``, ``target``,
``meets_target``), ``engine_vs_hf_generate_tokens_per_s_ratio`` (both tokens/s). Targets: fleet
η = 0 <= 1.25 x in-process, η = 1 <= 0.8 x; engine >= 2 x HF generate. Every row also carries
the 1-minute load average before and after the whole benchmark: on a shared machine the
figures are only as good as the quiet they were measured in.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional


from areal_async.base.plugins import load_callable
from areal_async.base.process import setup_torch_process
from areal_async.config import ModelConfig, load_config
from areal_async.data.prompts import PromptCursor, load_problems, prompt_encoder
from areal_async.models.tiny import build_model, load_policy, save_policy
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engine import GenRequest
from areal_async.rollout.torch_engine import TorchEngine
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.packing import select_attn_implementation
from areal_async.trainer.types import Trajectory
from benchmarks.common import write_rows
from benchmarks.common.cpu import cpu_per_step
from benchmarks.common.fleet import placement, run_fleet
from benchmarks.engine_vs_hf import measure as measure_engine_vs_hf

ALPHABET = "0123456789+="
WARMUP_STEPS = 5
DEFAULT_STEPS = 60
TARGETS = {0: 1.25, 1: 0.8}  # fleet / in-process ms per step, by eta
ENGINE_TARGET = 2.0
BASE_CONFIG = "configs/tiny_arith.yaml"
PHASES = ("gen", "reward", "train", "publish", "wait")
PLACEMENT_WORDS = {  # a fleet row's "placement" (see the module docstring)
    "none": "",
    "trainer_pinned": " (trainer pinned, the others anywhere)",
    "trainer_own_cpu": " (trainer on a CPU of its own)",
}


# --------------------------------------------------------------------------------------------
# the setup: model directory, dataset, config overrides
# --------------------------------------------------------------------------------------------


def build_setup(out: Path, seed: int = 1) -> tuple[Path, Path]:
    """Write the tiny model (+ its 16-token tokenizer) and the a+b jsonl under ``out``."""

    tok = build_char_tokenizer(ALPHABET)
    mcfg = ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model_dir, data = out / "model", out / "add.jsonl"
    save_policy(build_model(mcfg, len(tok), seed), tok, model_dir)
    with open(data, "w") as f:
        for a in range(10):
            for b in range(10):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "solutions": [str(a + b)]}) + "\n")
    return model_dir, data


def overrides(model_dir: Path, data: Path, steps: int) -> list[str]:
    """The small case as overrides of the CPU preset (shared by the in-process loop and the fleet)."""
    return [
        f"model.path={model_dir}",
        "train_dataset.type=jsonl",
        f"train_dataset.path={data}",
        "train_dataset.batch_size=32",
        "gconfig.n_samples=8",
        "gconfig.max_new_tokens=3",
        "actor.optimizer.lr=1e-3",
        "sft_warmup.steps=0",
        "cluster.n_rollout_workers=1",
        "cluster.n_reward_workers=1",
        "cluster.heartbeat_s=0.2",
        "rollout.dump_to_file=false",
        "reward.fn=areal_async.reward.exact:exact_match_reward",
        f"total_train_steps={steps}",
        "rollout.max_batch_groups=32",
    ]  # one decode batch holds the step's 32 groups


# --------------------------------------------------------------------------------------------
# (a) the in-process loop
# --------------------------------------------------------------------------------------------


class InProcessLoop:
    """Engine, reward function and PPO actor of the project in one loop (see the module docstring)."""

    def __init__(self, cfg):

        setup_torch_process(cfg.cluster)
        self.cfg = cfg
        model, self.tok = load_policy(cfg.model, cfg.seed)
        self.engine = TorchEngine(
            copy.deepcopy(model),
            self.tok,
            device="cpu",
            seed=cfg.seed * 1000,
            max_batch_groups=cfg.rollout.max_batch_groups,
        )
        model.set_attn_implementation(select_attn_implementation("cpu"))
        self.actor = PPOActor(model, cfg.actor, temperature=cfg.gconfig.temperature, total_steps=cfg.total_train_steps)
        self.reward_fn = load_callable(cfg.reward.fn)
        self.problems = load_problems(cfg.train_dataset, cfg.seed)
        self.cursor = PromptCursor(len(self.problems), cfg.seed, cfg.train_dataset.shuffle)
        self.encode = prompt_encoder(self.tok, cfg.train_dataset.template)
        self.version = 0

    def step(self) -> dict[str, float]:
        """One RL step; returns seconds per phase (and this process's CPU seconds as ``cpu``)."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.engine.update_weights(self.version, {k: v.detach() for k, v in self.actor.model.state_dict().items()})
        t1 = time.perf_counter()
        groups = self._generate()
        t2 = time.perf_counter()
        trajs = self._score(groups)
        t3 = time.perf_counter()
        self.actor.train_step(trajs)
        self.version += 1
        t4 = time.perf_counter()
        cpu = time.process_time() - c0
        return {
            "publish": t1 - t0,
            "gen": t2 - t1,
            "reward": t3 - t2,
            "train": t4 - t3,
            "wait": 0.0,
            "step": t4 - t0,
            "cpu": cpu,
        }

    def _generate(self) -> list[tuple]:

        g = self.cfg.gconfig
        reqs = {}
        for _ in range(self.cfg.train_dataset.batch_size):
            idx, pid = self.cursor.next()
            reqs[pid] = self.problems[idx]
            self.engine.add_request(
                GenRequest(
                    pid,
                    self.encode(self.problems[idx].prompt),
                    g.n_samples,
                    g.max_new_tokens,
                    g.temperature,
                    g.top_p,
                    g.greedy,
                )
            )
        done = []
        while self.engine.has_work():
            done += self.engine.step()
        return [(out, reqs[out.group_id]) for out in done]

    def _score(self, groups: list[tuple]) -> list:

        trajs = []
        for out, problem in groups:
            prompt = self.encode(problem.prompt)
            for i, s in enumerate(out.samples):
                text = self.tok.decode(s.output_ids, skip_special_tokens=True)
                score = float(self.reward_fn(text, list(problem.solutions)))
                trajs.append(
                    Trajectory(f"{out.group_id}-{i}", out.group_id, prompt, s.output_ids, s.logprobs, s.versions, score)
                )
        return trajs


def run_inprocess(cfg, steps: int, warmup: int) -> dict:
    loop = InProcessLoop(cfg)
    per_step = [loop.step() for _ in range(steps)][warmup:]
    return {k: 1000 * statistics.fmean(s[k] for s in per_step) for k in (*PHASES, "step", "cpu")}


def mean_legs(legs: list[dict]) -> dict:
    """Phase-wise mean of in-process legs (each a ``run_inprocess`` result)."""
    return {k: statistics.fmean(leg[k] for leg in legs) for k in legs[0]}


# --------------------------------------------------------------------------------------------
# (b) the fleet
# --------------------------------------------------------------------------------------------


def fleet_phases(rows: list[dict], warmup: int) -> dict:
    """ms per step by phase over rows[warmup:] (see the module docstring)."""
    if len(rows) < warmup + 2:
        raise ValueError(f"need at least {warmup + 2} metrics rows, got {len(rows)}")
    first, window = rows[warmup], rows[warmup + 1 :]
    n = len(window)
    step = (window[-1]["wall_s"] - first["wall_s"]) / n
    train = statistics.fmean(r["train_s"] + r.get("ahead_s", 0.0) for r in window)
    publish = statistics.fmean(r["publish_s"] for r in window)
    gen = (window[-1]["gen_busy_s_total"] - first["gen_busy_s_total"]) / n
    reward = (window[-1].get("reward_busy_s_total", 0.0) - first.get("reward_busy_s_total", 0.0)) / n
    ms = {
        "gen": gen,
        "reward": reward,
        "train": train,
        "publish": publish,
        "wait": step - train - publish,
        "step": step,
    }
    return {k: 1000 * v for k, v in ms.items()}


def run_fleet_eta(config: str, ovr: list[str], eta: int, run_dir: Path, warmup: int) -> dict:

    res = run_fleet(config, ovr + [f"rollout.max_head_offpolicyness={eta}"], run_dir)
    rows = res["rows"]
    out = fleet_phases(rows, warmup)
    by_role = {r: 1000 * s for r, s in cpu_per_step(res["cpu_samples"], warmup).items()}
    out["cpu"], out["cpu_by_role"] = (sum(by_role.values()) if by_role else None), by_role
    out["final_reward"] = statistics.fmean(r["reward_mean"] for r in rows[-10:])
    out["foreign_cpu_frac"] = res["foreign_cpu_frac"]
    return out


# --------------------------------------------------------------------------------------------
# (c) engine vs transformers generate
# --------------------------------------------------------------------------------------------


def engine_vs_hf(cfg, repeats: int) -> dict:
    """Tokens/s of TorchEngine and of HF ``generate`` on one batch of the benchmark's prompts
    (``benchmarks.engine_vs_hf.measure``: interleaved rounds, medians)."""

    setup_torch_process(cfg.cluster)
    model, tok = load_policy(cfg.model, cfg.seed)
    enc, g, B = prompt_encoder(tok, cfg.train_dataset.template), cfg.gconfig, cfg.train_dataset.batch_size
    prompts = [enc(p.prompt) for p in load_problems(cfg.train_dataset, cfg.seed)[:B]]
    return measure_engine_vs_hf(
        model,
        prompts,
        g.n_samples,
        g.max_new_tokens,
        tok.eos_token_id,
        tok.pad_token_id,
        repeats,
        cfg.seed,
        g.temperature,
        g.top_p,
    )


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def to_rows(inproc: dict, fleet: dict[int, dict], gen: Optional[dict], meta: dict) -> list[dict]:
    rows = [
        {
            "metric": "ms_per_step",
            "value": inproc["step"],
            "unit": "ms",
            "mode": "inprocess",
            "eta": None,
            **{f"{k}_ms": inproc[k] for k in PHASES},
            "cpu_ms": inproc.get("cpu"),
            "legs_ms": inproc.get("legs", [inproc["step"]]),
            **meta,
        }
    ]
    for eta, f in sorted(fleet.items()):
        rows.append(
            {
                "metric": "ms_per_step",
                "value": f["step"],
                "unit": "ms",
                "mode": "fleet",
                "eta": eta,
                **{f"{k}_ms": f[k] for k in PHASES},
                "cpu_ms": f.get("cpu"),
                "cpu_ms_by_role": f.get("cpu_by_role"),
                "final_reward": f["final_reward"],
                "foreign_cpu_frac": f["foreign_cpu_frac"],
                **meta,
                "placement": f.get("placement", "none"),
            }
        )
    for eta, f in sorted(fleet.items()):
        ratio, target = f["step"] / f.get("inprocess_step", inproc["step"]), TARGETS.get(eta)
        rows.append(
            {
                "metric": "fleet_vs_inprocess_ms_per_step_ratio",
                "value": ratio,
                "unit": "ratio",
                "eta": eta,
                "target": target,
                "meets_target": None if target is None else ratio <= target,
                "inprocess_ms": f.get("inprocess_step", inproc["step"]),
                **meta,
            }
        )
    if gen is not None:
        ratio = gen["engine_tokens_per_s"] / gen["hf_tokens_per_s"]
        rows.append(
            {
                "metric": "engine_vs_hf_generate_tokens_per_s_ratio",
                "value": ratio,
                "unit": "ratio",
                **gen,
                "target": ENGINE_TARGET,
                "meets_target": ratio >= ENGINE_TARGET,
                **meta,
            }
        )
    return rows


def print_table(inproc: dict, fleet: dict[int, dict], gen: Optional[dict], meta: dict) -> None:
    print(
        f"\noverhead: {meta['batch']} (steady window: steps {meta['warmup']}..{meta['steps'] - 1}); load "
        f"{meta['loadavg_before']:.2f} before, {meta['loadavg_after']:.2f} after, {meta['cpu_count']} CPUs"
    )
    cols = (*PHASES, "step", "cpu")
    print(f"{'run':<12} " + " ".join(f"{p:>8}" for p in cols) + f" {'x inproc':>9} {'target':>7}")
    print(f"{'in-process':<12} " + " ".join(_cell(inproc.get(p)) for p in cols))
    for eta, f in sorted(fleet.items()):
        ratio, target = f["step"] / f.get("inprocess_step", inproc["step"]), TARGETS.get(eta)
        verdict = "-" if target is None else f"<={target}" + ("" if ratio <= target else " NOT")
        print(
            f"{'fleet η=' + str(eta):<12} " + " ".join(_cell(f.get(p)) for p in cols) + f" {ratio:>9.3f} {verdict:>7}"
        )
    print("ms per step; fleet phases overlap at η > 0 (gen/reward/train/publish need not sum to step)")
    legs = inproc.get("legs", [])
    if len(legs) > 1:
        print(
            "in-process: the mean of legs run before, between and after the fleet runs, "
            + " / ".join(f"{v:.1f}" for v in legs)
            + " ms per step; each fleet run is divided by the mean of the two legs around it"
        )
    for eta, f in sorted(fleet.items()):
        roles = ", ".join(f"{r} {v:.1f}" for r, v in (f.get("cpu_by_role") or {}).items())
        where = PLACEMENT_WORDS[f.get("placement", "none")]
        print(f"fleet η={eta} CPU ms per step by role{where}: {roles or 'not sampled'}")
    if gen is not None:
        ratio = gen["engine_tokens_per_s"] / gen["hf_tokens_per_s"]
        print(
            f"engine {gen['engine_tokens_per_s']:.0f} tokens/s vs transformers generate "
            f"{gen['hf_tokens_per_s']:.0f} tokens/s ({gen.get('hf_baseline', 'hf')}): {ratio:.2f}x "
            f"(target >= {ENGINE_TARGET}x)"
        )


def _cell(v: Optional[float]) -> str:
    return f"{'-':>8}" if v is None else f"{v:>8.1f}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="key=value config overrides (any position) apply to every run"
    )
    ap.add_argument("--json", default=None, help="where to write the JSON list of rows")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps left out of the means")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2], help="fleet runs")
    ap.add_argument("--model-path", default=None, help="a local HF model instead of the built tiny one")
    ap.add_argument("--out", default=None, help="directory for the setup and run dirs (default: a temp dir)")
    ap.add_argument("--no-fleet", action="store_true", help="in-process loop and engine only")
    ap.add_argument("--gen-repeats", type=int, default=10, help="batches timed per generator")
    ap.add_argument(
        "--no-pin", action="store_true", help="leave every process unpinned (see the docstring, 'Placement')"
    )
    return ap


def main(argv: list[str] | None = None) -> list[dict]:

    argv = sys.argv[1:] if argv is None else list(argv)
    extra = [a for a in argv if "=" in a and not a.startswith("-")]
    args = _parser().parse_args([a for a in argv if a not in extra])
    if args.steps < args.warmup + 2 or args.warmup < 0 or min(args.etas) < 0:
        raise SystemExit(
            f"overhead: need --steps >= --warmup + 2 >= 2 and η >= 0; got steps {args.steps}, "
            f"warmup {args.warmup}, η {args.etas}"
        )
    out = Path(args.out or tempfile.mkdtemp(prefix="overhead-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    model_dir, data = build_setup(out)
    ovr = overrides(Path(args.model_path) if args.model_path else model_dir, data, args.steps) + extra
    cfg = load_config(BASE_CONFIG, ovr)
    allowed = os.sched_getaffinity(0)
    pin = [] if args.no_pin else placement(sorted(allowed), ovr)

    def on_trainer_cpu(fn, *a):  # the fleet trainer's CPU; the fleet's processes place themselves
        if pin:
            os.sched_setaffinity(0, {int(pin[0].split("=")[1])})
        try:
            return fn(*a)
        finally:
            os.sched_setaffinity(0, allowed)  # what the fleet's supervisor starts from

    def inprocess_leg() -> dict:
        return on_trainer_cpu(run_inprocess, cfg, args.steps, args.warmup)

    print(f"[overhead] setup in {out}; in-process loop, {args.steps} steps", flush=True)
    legs = [inprocess_leg()]
    gen = on_trainer_cpu(engine_vs_hf, cfg, args.gen_repeats)
    fleet = {}
    for eta in [] if args.no_fleet else sorted(set(args.etas)):
        print(f"[overhead] fleet η={eta}", flush=True)
        place = pin if eta >= 1 else pin[:1]  # pin[0]: the trainer's CPU
        fleet[eta] = run_fleet_eta(BASE_CONFIG, ovr + place, eta, out / f"eta{eta}", args.warmup)
        fleet[eta]["placement"] = "none" if not place else "trainer_own_cpu" if eta >= 1 else "trainer_pinned"
        print(f"[overhead] in-process loop, {args.steps} steps", flush=True)
        legs.append(inprocess_leg())
        fleet[eta]["inprocess_step"] = (legs[-2]["step"] + legs[-1]["step"]) / 2  # the legs around this run
    inproc = mean_legs(legs)
    inproc["legs"] = [leg["step"] for leg in legs]
    meta = {
        "batch": f"{cfg.train_dataset.batch_size} prompts x {cfg.gconfig.n_samples} samples, "
        f"{cfg.gconfig.max_new_tokens} new tokens",
        "steps": args.steps,
        "warmup": args.warmup,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "model": str(cfg.model.path),
        "inprocess_pinned": bool(pin),
    }
    print_table(inproc, fleet, gen, meta)
    rows = to_rows(inproc, fleet, gen, meta)
    if args.json:
        write_rows(args.json, rows)
        print(f"rows written to {args.json}")
    return rows


if __name__ == "__main__":
    main()
