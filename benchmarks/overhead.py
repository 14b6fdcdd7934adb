"""The system's own cost: fleet ms per step against an in-process loop on the same model and data.

    python -m benchmarks.overhead [--json PATH] [--steps N] [--etas 0 1 2] [--model-path DIR]
                                  [--out DIR] [--no-fleet] [--no-null] [--gen-repeats R] [--no-pin]
                                  [key=value ...]

One model, dataset and batch, run four ways:

(a) in-process: the project's own ``TorchEngine``, reward function and ``PPOActor`` in one Python loop
    (no processes, no sockets; torch threads as the fleet's workers): per step publish
    (``engine.update_weights``), generate, score, one ``train_step``. Two loops, measured in
    alternating order in every leg: ``plain`` (as first written: one ``decode`` per sample, per-sample
    trajectory views, no ``gc.freeze``) and ``matched`` (every optimisation of the fleet's roles one
    thread can use; ``MATCHED`` lists them and why the others do not apply). A leg runs before the
    first fleet run and after each (a fresh loop each).
(b) the fleet (``areal-async run``) at η = 0, 1, 2: one rollout worker, one reward worker, the trainer,
    the scheduler.
(c) the engine's tokens/s against ``transformers`` ``generate`` (``benchmarks.engine_vs_hf.measure``).
(d) a null run (``--no-null`` skips it): the legs again with a stand-in leg of the same loop where each
    fleet run was: how far its ratios are from 1 is how far the legs alone move a ratio.

Ratios (``benchmarks.common.legs``): per fleet run, loop and η, wall and CPU ms per step (CPU: every
process of the fleet, by role, over the loop's one process), each over the mean of the two legs around
the run and over the first leg alone. How to read them: ``benchmarks/README.md``; dated figures with
commit, machine and load: ``benchmarks/RESULTS.md``.

Setup (the issue's small case, built here, nothing downloaded): Llama, hidden 64, 2 layers, a 16-token
character vocabulary saved as an HF directory and loaded with ``model.path``; a jsonl a+b task (100
problems, exact-match reward); 32 prompts x 8 samples per step, 3 new tokens, lr 1e-3, no SFT warm-up.
``--model-path`` runs another local HF model (its tokenizer must encode the prompts).

Phases per step (ms, means over the steady window after ``--warmup`` steps): gen (fleet: the rollout
worker's ``busy_s``), reward (fleet: wall time the reward worker had a group in its pool; in-process it
includes decoding and building trajectories), train (``train_step`` with the proximal recompute; fleet:
``train_s`` + ``ahead_s``, the first forward run ahead at η = 0), publish (fleet: ``publish_s``, until
the channel released the publisher; the rollout side's load is inside gen), wait
(fleet: step - train - publish, understated by the overlapped parts; in-process 0), step (wall), cpu
(by role in ``cpu_ms_by_role``). At η > 0 the phases of different steps overlap.
Placement: with 2+ CPUs the trainer is pinned to one CPU and the in-process loops run there; at η >= 1
the other roles are pinned to the rest (``benchmarks.common.fleet.placement``), at η = 0 (serial
phases) they stay unpinned. ``--no-pin`` pins nothing; ``cluster.cpu_affinity.*`` overrides win.

JSON rows (``metric``, ``value``, ``unit`` always): ``ms_per_step`` (``mode`` inprocess per ``baseline``
with ``legs_ms``, ``legs_cpu_ms``, ``null_legs_ms``, ``null_stand_in_ms``; fleet per ``eta`` with
``cpu_ms_by_role``), the ratio rows ``fleet_vs_inprocess_*`` and ``null_vs_inprocess_*`` (``eta``,
``baseline``, ``framing``, ``numerator``, ``denominator``; fleet wall ratios judged against ``target``)
and ``engine_vs_hf_generate_tokens_per_s_ratio``; every row the load average before and after. The wall
ratio over the legs around with ``baseline`` plain is the one this benchmark reported before the others.
Targets: fleet η = 0 <= 1.25 x in-process, η = 1 <= 0.8 x; engine >= 2 x HF generate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional


from areal_async.base.process import setup_torch_process
from areal_async.config import ModelConfig, load_config
from areal_async.data.prompts import load_problems, prompt_encoder
from areal_async.models.tiny import build_model, load_policy, save_policy
from areal_async.models.tokenizer import build_char_tokenizer
from benchmarks.common import Col, write_rows
from benchmarks.common import print_table as print_rows_table
from benchmarks.common.cpu import cpu_per_step
from benchmarks.common.fleet import placement, run_fleet
from benchmarks.common.inprocess import PHASES, VARIANTS, run_inprocess
from benchmarks.common.legs import ratio_rows
from benchmarks.engine_vs_hf import measure as measure_engine_vs_hf

ALPHABET = "0123456789+="
WARMUP_STEPS = 5
DEFAULT_STEPS = 60
TARGETS = {0: 1.25, 1: 0.8}  # fleet / in-process ms per step, by eta
ENGINE_TARGET = 2.0
BASE_CONFIG = "configs/tiny_arith.yaml"
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
        "reward.fn=areal_async.reward.exact:exact_match_reward",
        f"total_train_steps={steps}",
        "rollout.max_batch_groups=32",
    ]  # one decode batch holds the step's 32 groups


# --------------------------------------------------------------------------------------------
# (a) the in-process loop
# --------------------------------------------------------------------------------------------


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


def to_rows(legs: dict[str, dict], fleet: dict[int, dict], gen: Optional[dict], meta: dict) -> list[dict]:
    """All rows. ``legs[baseline]``: {"legs": [leg, ...] around the fleet runs, "null_legs": [...],
    "null_stand_ins": {eta: leg}} (legs as ``run_inprocess`` returns them; the null run's may be
    empty: the k-th stand-in, in eta order, ran between null legs k and k + 1)."""
    rows = [_inprocess_row(v, L, meta) for v, L in legs.items()]
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
    for v, L in legs.items():
        rows += ratio_rows("fleet", fleet, L["legs"][: len(fleet) + 1], v, TARGETS, meta)
        if L.get("null_stand_ins"):
            rows += ratio_rows("null", L["null_stand_ins"], L["null_legs"], v, {}, meta)
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


def _inprocess_row(baseline: str, L: dict, meta: dict) -> dict:
    mean = mean_legs(L["legs"])
    return {
        "metric": "ms_per_step",
        "value": mean["step"],
        "unit": "ms",
        "mode": "inprocess",
        "baseline": baseline,
        "eta": None,
        **{f"{k}_ms": mean[k] for k in PHASES},
        "cpu_ms": mean.get("cpu"),
        "legs_ms": [leg["step"] for leg in L["legs"]],
        "legs_cpu_ms": [leg.get("cpu") for leg in L["legs"]],
        "null_legs_ms": [leg["step"] for leg in L.get("null_legs", [])],
        "null_stand_in_ms": [leg["step"] for _, leg in sorted(L.get("null_stand_ins", {}).items())],
        **meta,
    }


RATIO_COLS = [
    Col("run", 12, lambda r: f"{r['subject']} η={r['eta']}", left=True),
    Col("baseline", 8, lambda r: r["baseline"], left=True),
    Col("wall/legs", 9, lambda r: r.get("fleet_vs_inprocess_ms_per_step_ratio"), ".3f"),
    Col("wall/first", 10, lambda r: r.get("fleet_vs_inprocess_ms_per_step_first_leg_ratio"), ".3f"),
    Col("cpu/legs", 8, lambda r: r.get("fleet_vs_inprocess_cpu_ms_per_step_ratio"), ".3f"),
    Col("cpu/first", 9, lambda r: r.get("fleet_vs_inprocess_cpu_ms_per_step_first_leg_ratio"), ".3f"),
    Col("target", 7, lambda r: r.get("target"), ".2f"),
]


def ratio_table(rows: list[dict]) -> list[dict]:
    """One line per (subject, eta, baseline) with its four ratios, keyed by the fleet's metric names."""
    lines: dict[tuple, dict] = {}
    for r in rows:
        subject = r["metric"].split("_vs_")[0]
        if r["unit"] != "ratio" or subject not in ("fleet", "null"):
            continue
        line = lines.setdefault((subject, r["eta"], r["baseline"]), {"subject": subject, "eta": r["eta"]})
        line.update(baseline=r["baseline"], **{"fleet" + r["metric"][len(subject) :]: r["value"]})
        if r.get("target") is not None:
            line["target"] = r["target"]
    return [lines[k] for k in sorted(lines, key=lambda k: (k[0] != "fleet", k[1], k[2]))]


def print_table(rows: list[dict], meta: dict) -> None:
    print(
        f"\noverhead: {meta['batch']} (steady window: steps {meta['warmup']}..{meta['steps'] - 1}); load "
        f"{meta['loadavg_before']:.2f} before, {meta['loadavg_after']:.2f} after, {meta['cpu_count']} CPUs"
    )
    cols = (*PHASES, "step", "cpu")
    print(f"{'run':<20} " + " ".join(f"{p:>8}" for p in cols))
    for r in rows:
        if r["metric"] == "ms_per_step":
            name = f"in-process {r['baseline']}" if r["mode"] == "inprocess" else f"fleet η={r['eta']}"
            print(f"{name:<20} " + " ".join(_cell(r.get(f"{p}_ms") if p != "step" else r["value"]) for p in cols))
    print("ms per step; fleet phases overlap at η > 0 (gen/reward/train/publish need not sum to step)")
    for r in rows:
        if r["metric"] == "ms_per_step" and r["mode"] == "inprocess":
            null = " / ".join(f"{v:.1f}" for v in r["null_legs_ms"])
            print(
                f"in-process {r['baseline']} legs (wall ms): "
                + " / ".join(f"{v:.1f}" for v in r["legs_ms"])
                + (
                    f"; null run legs {null}, stand-ins " + " / ".join(f"{v:.1f}" for v in r["null_stand_in_ms"])
                    if null
                    else ""
                )
            )
        elif r["metric"] == "ms_per_step":
            roles = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("cpu_ms_by_role") or {}).items())
            print(
                f"fleet η={r['eta']} CPU ms per step by role{PLACEMENT_WORDS[r['placement']]}: {roles or 'not sampled'}"
            )
    print("\nratios (run / in-process; legs: the mean of the two legs around the run; first: the first leg)")
    print_rows_table(ratio_table(rows), RATIO_COLS)
    for r in rows:
        if r["metric"] == "engine_vs_hf_generate_tokens_per_s_ratio":
            print(
                f"engine {r['engine_tokens_per_s']:.0f} tokens/s vs transformers generate "
                f"{r['hf_tokens_per_s']:.0f} tokens/s ({r.get('hf_baseline', 'hf')}): {r['value']:.2f}x "
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
    ap.add_argument("--no-fleet", action="store_true", help="in-process loops and engine only")
    ap.add_argument("--no-null", action="store_true", help="skip the null run (legs with no fleet between)")
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

    pairs = iter(range(10**6))

    def leg_pair(into: str, eta: Optional[int] = None) -> None:  # both loops, in alternating order
        order = VARIANTS if next(pairs) % 2 == 0 else VARIANTS[::-1]
        print(f"[overhead] in-process loops ({' then '.join(order)}), {args.steps} steps each", flush=True)
        for v in order:
            leg = on_trainer_cpu(run_inprocess, cfg, args.steps, args.warmup, v == "matched")
            if eta is None:
                legs[v][into].append(leg)
            else:
                legs[v][into][eta] = leg

    legs = {v: {"legs": [], "null_legs": [], "null_stand_ins": {}} for v in VARIANTS}
    leg_pair("legs")
    gen = on_trainer_cpu(engine_vs_hf, cfg, args.gen_repeats)
    fleet = {}
    etas = [] if args.no_fleet else sorted(set(args.etas))
    for eta in etas:
        print(f"[overhead] fleet η={eta}", flush=True)
        place = pin if eta >= 1 else pin[:1]  # pin[0]: the trainer's CPU
        fleet[eta] = run_fleet_eta(BASE_CONFIG, ovr + place, eta, out / f"eta{eta}", args.warmup)
        fleet[eta]["placement"] = "none" if not place else "trainer_own_cpu" if eta >= 1 else "trainer_pinned"
        leg_pair("legs")
    if not args.no_null:
        print("[overhead] null run: the legs again, a stand-in leg where each fleet run was", flush=True)
        leg_pair("null_legs")
        for eta in etas or sorted(set(args.etas)):
            leg_pair("null_stand_ins", eta)
            leg_pair("null_legs")
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
    rows = to_rows(legs, fleet, gen, meta)
    print_table(rows, meta)
    if args.json:
        write_rows(args.json, rows)
        print(f"rows written to {args.json}")
    return rows


if __name__ == "__main__":
    main()
