"""The trainer's GPU paths: its process group's backend (item 1 of issue 23).

``trainer_group_backend``: two ranks join the group with ``trainer_backend(dev)`` (on CUDA the mixed
"cpu:gloo,cuda:nccl", both ranks on GPU 0: only the CPU control collectives run, over gloo; NCCL would
refuse two ranks on one GPU) and run every control collective of ``DataParallel`` plus
``broadcast_module``; each collective's tensors are recorded and must be on a device the backend serves
(torch's own ``BackendConfig`` parsing), and each result must be the one computed here by hand.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from areal_async.trainer.compute.dp import DataParallel, broadcast_module, trainer_backend
from areal_async.trainer.algo.loss import LossStats
from protocols.trajectories import Trajectory
from benchmarks.gpu_check.registry import Result
from protocols.ports import free_tcp_port

COLLECTIVES = ("broadcast", "all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
PHASES = ("broadcast_module", "command", "broadcast_batch", "all_gather_per_seq", "sum_stats")
SHARES, LENGTHS = [[0, 2], [1]], [2, 1, 3]
# by hand: rank r fills sequence i with 10 * i + r; rank 0 owns 0 and 2, rank 1 owns 1
GATHERED = [[0.0, 0.0], [11.0], [20.0, 20.0, 20.0]]
STATS = (7.0, 2.0)  # n_tokens 3 + 4 summed, iw_max max(1, 2)


def served_devices(backend: str) -> set[str]:
    """Device types a backend string serves, as torch parses it (distributed_c10d.BackendConfig)."""
    return set(BackendConfig(Backend(backend)).get_device_backend_map())


def control_trajectories() -> list[Trajectory]:
    return [
        Trajectory(
            f"s{i}",
            f"g{i % 2}",
            [1, 2, 3][: 1 + i % 3],
            [4, 5, 6, 7][: 1 + i],
            [-1.5] * (i + 1),
            [i] * (i + 1),
            float(i),
        )
        for i in range(4)
    ]


def _record(seen: list, phase: list) -> None:
    """Wrap torch.distributed's collectives: (phase, collective, device type) of every tensor they get."""
    for op in COLLECTIVES:
        real = getattr(dist, op)

        def wrapped(*args, _real=real, _op=op, **kw):
            for t in args[:2]:
                for x in t if isinstance(t, list) else [t]:
                    if isinstance(x, torch.Tensor):
                        seen.append((phase[0], _op, x.device.type))
            return _real(*args, **kw)

        setattr(dist, op, wrapped)


def control_collectives(rank: int, port: int, backend: str, dev: str, out_path: str) -> None:
    """One of two ranks: every control collective, its tensors' devices recorded; results saved to ``out_path``."""
    if dev == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen, phase = [], ["?"]
    _record(seen, phase)
    dp, got = DataParallel(rank, 2), {}
    phase[0] = "broadcast_module"
    torch.manual_seed(rank)  # different weights per rank until the broadcast (the model is still on the host)
    model = torch.nn.Linear(3, 2)
    broadcast_module(model)
    got["weight"] = model.weight.detach().clone()
    phase[0] = "command"
    got["command"] = dp.command(2, 7, "save here") if rank == 0 else dp.command()
    phase[0] = "broadcast_batch"
    batch = dp.broadcast_batch(control_trajectories() if rank == 0 else None)
    got["batch"] = [(t.output_ids.tolist(), t.versions.tolist(), t.score) for t in batch]
    phase[0] = "all_gather_per_seq"
    mine = {i: torch.full((LENGTHS[i],), float(10 * i + rank)) for i in SHARES[rank]}
    got["gathered"] = [t.tolist() for t in dp.all_gather_per_seq(mine, SHARES, LENGTHS)]
    phase[0] = "sum_stats"
    stats = dp.sum_stats(LossStats(n_tokens=3.0 + rank, iw_max=1.0 + rank))
    got["stats"] = (stats.n_tokens, stats.iw_max)
    # no barrier: on the mixed backend it may take the NCCL side (two ranks on one GPU); sum_stats synchronised
    dist.destroy_process_group()
    torch.save({"seen": seen, "got": got}, out_path)


def run_two_ranks(backend: str, dev: str, out_dir: str, timeout_s: float = 90.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_tcp_port("127.0.0.1")
    paths = [os.path.join(out_dir, f"rank{r}.pt") for r in (0, 1)]
    procs = [ctx.Process(target=control_collectives, args=(r, port, backend, dev, paths[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"trainer ranks exited with {codes}")
    return [torch.load(p, weights_only=False) for p in paths]


def control_problems(ranks: list[dict], backend: str) -> list[str]:
    """What is wrong with two ranks' records: results unlike the hand-computed ones, unserved devices."""
    g0, g1 = ranks[0]["got"], ranks[1]["got"]
    want = [(t.output_ids.tolist(), t.versions.tolist(), t.score) for t in control_trajectories()]
    bad = [
        name
        for name, ok in (
            ("broadcast_module", torch.equal(g0["weight"], g1["weight"])),
            ("command", g1["command"] == (2, 7, "save here")),
            ("broadcast_batch", g0["batch"] == want and g1["batch"] == want),
            ("all_gather_per_seq", g0["gathered"] == g1["gathered"] == GATHERED),
            ("sum_stats", g0["stats"] == g1["stats"] == STATS),
        )
        if not ok
    ]
    seen = {s for r in ranks for s in r["seen"]}
    if {s[0] for s in seen} != set(PHASES):
        bad.append(f"phases seen {sorted({s[0] for s in seen})}, expected {sorted(PHASES)}")
    served = served_devices(backend)
    bad += [
        f"{p}: {op} got a {d} tensor; {backend!r} serves {sorted(served)}"
        for p, op, d in sorted(seen)
        if d not in served
    ]
    return bad


def trainer_group_backend(dev: str) -> Result:
    """On CPU the ranks run on gloo and their tensors are also checked against the CUDA backend's devices."""
    backend, cuda_backend = trainer_backend(dev), trainer_backend("cuda")
    with tempfile.TemporaryDirectory(prefix="gpu-check-pg-") as d:
        ranks = run_two_ranks(backend, dev, d)
    bad = control_problems(ranks, backend) + (control_problems(ranks, cuda_backend) if dev != "cuda" else [])
    data = {"backend": backend, "serves": sorted(served_devices(backend)), "cuda_backend": cuda_backend}
    if bad:
        return Result(False, "; ".join(bad), data)
    return Result(
        True, f"{backend!r}: the five control collectives ran on 2 ranks, every tensor on a served device", data
    )
