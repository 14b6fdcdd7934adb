"""Trainer throughput with 1 vs 2 data-parallel CPU ranks on the same batch (gloo, FSDP2).

    python -m benchmarks.trainer_ranks --json out.json [--repeats 5] [--hidden 128] [--layers 2]

One PPO ``train_step`` (decoupled loss, prox recompute, 1 minibatch) on a fixed batch shaped
like tiny_arith's (128 sequences of 8 prompt + 12 output tokens by default, ``--seqs``,
``--out-len``), a tiny Llama (vocab 64, ``--hidden``, ``--layers``), float32, one torch thread
per process, each process pinned to a CPU of its own when the machine allows. Three set-ups, run
in turn ``--rounds`` times, each timed as the median of its ``--repeats`` steps (after a warm-up
step) over all rounds:

- ``plain_1``: one process, no process group, no FSDP (the trainer at K = 1);
- ``fsdp_1``: FSDP2 on a gloo group of one rank (what sharding costs with nobody to share with);
- ``fsdp_2``: FSDP2 on 2 gloo ranks, each pinned to its own CPU when the machine allows 2;
- ``plain_1_fused``: the default K = 1 trainer, whose proximal logprobs come from the update's
  own forward (``PPOActor.prox_from_update``): one forward fewer per step than the others.

Equal work: K > 1 ranks cannot take the proximal logprobs from the update's forward (each rank
needs the others' shares first), so ``fsdp_2`` runs a forward of its own for them; ``plain_1``
and ``fsdp_1`` are made to run it too (``prox_from_update`` off), so the three compared set-ups run
the same forwards and backward per step. Each process counts the packed forwards it runs
(``forwards_per_step`` in the rows, per rank) and the benchmark refuses to compare set-ups whose
counts differ. ``plain_1_fused`` is there to show what the fused forward saves at K = 1.

tokens/s counts every token of the batch (prompt + output) per wall second of ``train_step``
(the slowest rank's). The ratio ``fsdp_2 / plain_1`` is what a second rank buys here; the
``cores`` column says how many CPUs the ranks had and ``load_avg_1m`` (mean over the set-up's
starts) how busy the machine was: on a shared machine the ratio is noisy either way.
Not measured: GPUs/NCCL, weight publication, models big enough that compute dwarfs the collectives.
Each JSON row: metric, value, unit, setup, cores, load_avg_1m, forwards_per_step. Dated
figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import time

import torch
import transformers

from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_async.trainer import actor as actor_mod
from areal_async.trainer.compute import logprobs as logprobs_mod
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.dp import DataParallel
from protocols.trajectories import Trajectory
from benchmarks.common import write_rows
from protocols.sockets import free_tcp_port


def model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg)


def batch(n: int, prompt_len: int, out_len: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(1, 64, (prompt_len + out_len,), generator=g).tolist()
        behav = (-4.0 + 0.3 * torch.randn(out_len, generator=g)).tolist()
        out.append(
            Trajectory(f"s{i}", f"g{i // 4}", ids[:prompt_len], ids[prompt_len:], behav, [0] * out_len, float(i % 2))
        )
    return out


def actor_cfg() -> ActorConfig:
    return ActorConfig(
        use_decoupled_loss=True,
        recompute_logprob=True,
        reward_scaling=10.0,
        reward_bias=-0.5,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=4096),
        optimizer=OptimizerConfig(lr=1e-5),
    )


def time_steps(actor: PPOActor, trajs: list[Trajectory], repeats: int) -> tuple[list[float], float]:
    """(seconds per timed step, packed forwards per step) after one warm-up step."""
    actor.train_step(trajs)  # warm-up
    out = []
    with counting_forwards() as forwards:
        for _ in range(repeats):
            t = time.perf_counter()
            actor.train_step(trajs)
            out.append(time.perf_counter() - t)
    return out, forwards() / repeats


@contextlib.contextmanager
def counting_forwards():
    """Count every packed forward inside the block (the trainer's forwards all go through
    ``packing.forward_packed``: from ``logprobs`` and from the actor's padding passes); yields a
    function giving the count so far. Patches those two modules' names for the block's duration."""
    n, real = [0], (actor_mod.forward_packed, logprobs_mod.forward_packed)

    def counted(*a, **kw):
        n[0] += 1
        return real[1](*a, **kw)

    actor_mod.forward_packed = logprobs_mod.forward_packed = counted
    try:
        yield lambda: n[0]
    finally:
        actor_mod.forward_packed, logprobs_mod.forward_packed = real


def _rank(rank: int, world: int, port: int, args: dict, q, fsdp: bool, fused: bool) -> None:
    """One process: pinned to its own CPU (rank r -> the r-th allowed CPU), one torch thread."""
    import torch.distributed as dist

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= world:
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    if fsdp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        actor = PPOActor(
            model(args["hidden"], args["layers"]),
            actor_cfg(),
            1.0,
            100,
            dp=DataParallel(rank, world),
            compute_dtype=torch.float32,
        )
    else:
        actor = PPOActor(model(args["hidden"], args["layers"]), actor_cfg(), 1.0, 100)
    if not fused:
        actor.prox_from_update = False  # the proximal logprobs' own forward, as K > 1 ranks run it
    trajs = batch(args["seqs"], args["prompt_len"], args["out_len"])
    q.put((rank, *time_steps(actor, trajs, args["repeats"])))
    if fsdp:
        dist.destroy_process_group()


def rank_times(world: int, args: dict, fsdp: bool = True, fused: bool = False) -> tuple[list[float], list[float]]:
    """(per repeat, the slowest rank's step time; per rank, packed forwards per step)."""
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_tcp_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, q, fsdp, fused)) for r in range(world)]
    for p in procs:
        p.start()
    got = {rank: (times, fwd) for rank, times, fwd in (q.get(timeout=1200) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    return [max(ts) for ts in zip(*(t for t, _ in got.values()))], [got[r][1] for r in sorted(got)]


# (name, ranks, FSDP2, proximal logprobs from the update's forward)
SETUPS = (
    ("plain_1", 1, False, False),
    ("fsdp_1", 1, True, False),
    ("fsdp_2", 2, True, False),
    ("plain_1_fused", 1, False, True),
)
COMPARED = ("plain_1", "fsdp_1", "fsdp_2")  # the set-ups whose forwards must be equal


def check_equal_forwards(forwards: dict[str, list[float]]) -> None:
    """Refuse a comparison of set-ups whose ranks ran different numbers of forwards per step."""
    counts = {s: sorted(set(forwards[s])) for s in COMPARED if s in forwards}
    if len({tuple(c) for c in counts.values()}) > 1 or any(len(c) > 1 for c in counts.values()):
        raise RuntimeError(f"forwards per step differ between the compared set-ups (per rank): {counts}")


def rows(args: dict) -> list[dict]:
    """The set-ups run in turn, ``rounds`` times (so a change in machine load hits all of them);
    each set-up's figure is the median over all its steps."""
    tokens = args["seqs"] * (args["prompt_len"] + args["out_len"])
    n_cpu = len(os.sched_getaffinity(0))
    times: dict[str, list[float]] = {s[0]: [] for s in SETUPS}
    loads: dict[str, list[float]] = {s[0]: [] for s in SETUPS}
    forwards: dict[str, list[float]] = {s[0]: [] for s in SETUPS}
    for _ in range(args["rounds"]):
        for setup, world, fsdp, fused in SETUPS:
            loads[setup].append(os.getloadavg()[0])
            step_s, fwd = rank_times(world, args, fsdp, fused)
            times[setup] += step_s
            forwards[setup] += fwd
    check_equal_forwards(forwards)
    out, rate = [], {}
    load = statistics.mean(x for v in loads.values() for x in v)
    for setup, world, _, _ in SETUPS:
        med = statistics.median(times[setup])
        rate[setup] = tokens / med
        common = {
            "setup": setup,
            "cores": min(world, n_cpu),
            "load_avg_1m": statistics.mean(loads[setup]),
            "forwards_per_step": statistics.mean(forwards[setup]),
        }
        out.append({"metric": f"train_step_s_{setup}", "value": med, "unit": "s", **common})
        out.append({"metric": f"tokens_per_s_{setup}", "value": rate[setup], "unit": "tokens/s", **common})
    out.append(
        {
            "metric": "ratio_fsdp_2_over_plain_1",
            "value": rate["fsdp_2"] / rate["plain_1"],
            "unit": "x",
            "setup": "fsdp_2 / plain_1",
            "cores": min(2, n_cpu),
            "load_avg_1m": load,
            "forwards_per_step": statistics.mean(forwards["fsdp_2"]),
        }
    )
    out.append(
        {
            "metric": "ratio_fsdp_2_over_fsdp_1",
            "value": rate["fsdp_2"] / rate["fsdp_1"],
            "unit": "x",
            "setup": "fsdp_2 / fsdp_1",
            "cores": min(2, n_cpu),
            "load_avg_1m": load,
            "forwards_per_step": statistics.mean(forwards["fsdp_2"]),
        }
    )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the JSON list of rows")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per set-up and round")
    ap.add_argument("--rounds", type=int, default=2, help="times the set-ups run in turn")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--out-len", type=int, default=12)
    a = ap.parse_args(argv)
    args = {
        "repeats": a.repeats,
        "rounds": a.rounds,
        "hidden": a.hidden,
        "layers": a.layers,
        "seqs": a.seqs,
        "prompt_len": a.prompt_len,
        "out_len": a.out_len,
    }
    out = rows(args)
    print(f"{'metric':32s} {'value':>12s}  unit      cores  load  forwards/step")
    for r in out:
        print(
            f"{r['metric']:32s} {r['value']:>12.4g}  {r['unit']:8s}  {r['cores']:>5}  {r['load_avg_1m']:4.1f}  "
            f"{r['forwards_per_step']:.1f}"
        )
    write_rows(a.json, out)
    return out


if __name__ == "__main__":
    main()
