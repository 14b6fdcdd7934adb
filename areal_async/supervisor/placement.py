"""Which devices each process gets: pure functions from the cluster's shape to a placement.

The cluster is ``n_nodes`` machines of ``n_gpus_per_node`` GPUs. GPUs are numbered globally,
node by node (global g is GPU ``g % n_gpus_per_node`` of node ``g // n_gpus_per_node``), and
handed out in one pass:

    global GPUs  [ rollout 0 | rollout 1 | ... | trainer rank 0 | trainer rank 1 | ... | unused ]

- rollout workers share the rollout GPUs evenly (``sglang:dN``: N GPUs over the rollout workers,
  N divisible by their count; the embedded ``torch`` engine on CUDA: one GPU per worker);
- every trainer rank gets exactly one GPU (NCCL refuses two ranks on one device);
- the scheduler and reward workers get none (``CUDA_VISIBLE_DEVICES=""``).

A process's GPUs never span nodes. On CPU (``cluster.device=cpu``) nobody gets a GPU and the
environment is left alone; the processes are dealt over the nodes in start order (scheduler, reward
workers, trainer ranks, rollout workers: process i on node i mod ``n_nodes``). ``LOCAL_RANK`` is
a trainer rank's index among the trainer ranks of its node (torchrun's meaning); with
``CUDA_VISIBLE_DEVICES`` naming one GPU that GPU is ``cuda:0`` inside the process.

Refusals (``PlacementError``, before anything starts): more GPUs asked than the cluster has;
rollout GPUs that do not divide over the rollout workers; a process whose GPUs would span nodes;
a machine that has fewer GPUs than the node asks of it (``check_gpus_present``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_async.config import ExperimentConfig, rollout_dp_degree


class PlacementError(ValueError):
    """The cluster cannot hold the processes as asked; the message names the numbers."""


@dataclass(frozen=True)
class Slot:
    """The devices of one process."""

    node: int
    gpus: tuple[int, ...] = ()  # node-local GPU indices
    local_rank: Optional[int] = None  # trainer ranks only

    def env(self) -> dict[str, str]:
        """Environment variables this process starts with (GPU runs only)."""
        out = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.gpus)}
        if self.local_rank is not None:
            out["LOCAL_RANK"] = str(self.local_rank)
        return out

    def as_dict(self) -> dict:
        return {"node": self.node, "gpus": list(self.gpus), "local_rank": self.local_rank}


@dataclass(frozen=True)
class ClusterShape:
    """What the placement needs to know about the run (built from the config by ``shape_of``)."""

    n_nodes: int
    n_gpus_per_node: int
    device: str  # cpu | cuda
    n_trainer_ranks: int
    n_rollout_workers: int
    rollout_gpus: int  # GPUs for all rollout workers together (0 on CPU)
    extra_workers: tuple[str, ...] = field(default=())  # scheduler, reward-i: no GPU


def rollout_gpu_count(backend: str, device: str, n_rollout_workers: int, dp_degree: int) -> int:
    """GPUs the rollout fleet needs: dN for ``sglang:dN``, one per worker for ``torch`` on CUDA."""
    if device != "cuda":
        return 0
    return dp_degree if backend.startswith("sglang") else n_rollout_workers


def trainer_names(n_ranks: int) -> list[str]:
    """Worker ids of the trainer ranks: 'trainer' is rank 0 (the one on the control plane)."""
    return ["trainer"] + [f"trainer-{r}" for r in range(1, n_ranks)]


def _take(start: int, count: int, per_node: int, who: str) -> tuple[int, tuple[int, ...]]:
    """(node, local GPUs) of global GPUs [start, start + count); refuse a span across nodes."""
    node = start // per_node
    last_node = (start + count - 1) // per_node
    if last_node != node:
        raise PlacementError(
            f"{who} would get global GPUs {start}..{start + count - 1}, spanning nodes {node} and "
            f"{last_node} ({per_node} GPUs per node); use a GPU count per process that divides "
            f"cluster.n_gpus_per_node={per_node}"
        )
    return node, tuple(g % per_node for g in range(start, start + count))


def place(shape: ClusterShape) -> dict[str, Slot]:
    """Worker id -> Slot for every process of the run (see the module docstring)."""
    if shape.n_trainer_ranks < 1:
        raise PlacementError(f"cluster.n_trainer_ranks={shape.n_trainer_ranks}: expected an integer >= 1")
    rollout = [f"rollout-{i}" for i in range(shape.n_rollout_workers)]
    trainers = trainer_names(shape.n_trainer_ranks)
    if shape.device != "cuda":
        return _deal_cpu(list(shape.extra_workers), trainers, rollout, shape.n_nodes)
    out = {w: Slot(node=0) for w in shape.extra_workers}
    _check_total(shape)
    per_worker = shape.rollout_gpus // max(1, shape.n_rollout_workers)
    pos, per_node = 0, shape.n_gpus_per_node
    for w in rollout:
        node, gpus = _take(pos, per_worker, per_node, w)
        out[w], pos = Slot(node, gpus), pos + per_worker
    locals_on: dict[int, int] = {}
    for w in trainers:
        node, gpus = _take(pos, 1, per_node, w)
        out[w], pos = Slot(node, gpus, local_rank=locals_on.get(node, 0)), pos + 1
        locals_on[node] = locals_on.get(node, 0) + 1
    return out


def _deal_cpu(extra: list[str], trainers: list[str], rollout: list[str], n_nodes: int) -> dict[str, Slot]:
    """A CPU run: the processes dealt over the nodes in start order (scheduler, reward workers, trainer
    ranks, rollout workers), process i on node i mod n_nodes; one node holds them all when n_nodes = 1."""
    out: dict[str, Slot] = {}
    locals_on: dict[int, int] = {}
    for i, w in enumerate(extra + trainers + rollout):
        node = i % n_nodes
        if w in trainers:
            out[w] = Slot(node, local_rank=locals_on.get(node, 0))
            locals_on[node] = locals_on.get(node, 0) + 1
        else:
            out[w] = Slot(node)
    return out


def _check_total(shape: ClusterShape) -> None:
    total = shape.n_nodes * shape.n_gpus_per_node
    need = shape.rollout_gpus + shape.n_trainer_ranks
    if need > total:
        raise PlacementError(
            f"the run needs {need} GPUs ({shape.rollout_gpus} rollout + {shape.n_trainer_ranks} "
            f"trainer ranks) but cluster.n_nodes * cluster.n_gpus_per_node = {shape.n_nodes} * "
            f"{shape.n_gpus_per_node} = {total}"
        )
    if shape.n_rollout_workers and shape.rollout_gpus % shape.n_rollout_workers:
        raise PlacementError(
            f"{shape.rollout_gpus} rollout GPUs do not divide over cluster.n_rollout_workers="
            f"{shape.n_rollout_workers}; expected a multiple of it"
        )
    if shape.n_rollout_workers and shape.rollout_gpus < shape.n_rollout_workers:
        raise PlacementError(
            f"{shape.rollout_gpus} rollout GPUs for cluster.n_rollout_workers="
            f"{shape.n_rollout_workers}: expected at least one GPU per rollout worker"
        )


def gpus_needed_on(placement: dict[str, Slot], node: int) -> int:
    """How many GPUs of ``node`` the placement uses (highest local index + 1)."""
    used = [g for s in placement.values() if s.node == node for g in s.gpus]
    return max(used) + 1 if used else 0


def check_gpus_present(placement: dict[str, Slot], node: int, available: int) -> None:
    """PlacementError when this machine (``node``) has fewer GPUs than the placement uses on it."""
    need = gpus_needed_on(placement, node)
    if need > available:
        raise PlacementError(
            f"node {node} needs {need} GPUs for this placement but this machine has {available}; "
            "lower cluster.n_trainer_ranks / the rollout backend's dN, or run on a bigger machine"
        )


def shape_of(cfg: ExperimentConfig) -> ClusterShape:
    """The placement's view of a run's config."""
    cl = cfg.cluster
    extra = ("scheduler",) + tuple(f"reward-{i}" for i in range(cl.n_reward_workers))
    backend = cfg.rollout.backend
    gpus = rollout_gpu_count(backend, cl.device, cl.n_rollout_workers, rollout_dp_degree(backend))
    return ClusterShape(
        n_nodes=cl.n_nodes,
        n_gpus_per_node=cl.n_gpus_per_node,
        device=cl.device,
        n_trainer_ranks=cl.n_trainer_ranks,
        n_rollout_workers=cl.n_rollout_workers,
        rollout_gpus=gpus,
        extra_workers=extra,
    )


def local_gpu_count(environ: Optional[dict] = None, dev: Path = Path("/dev")) -> int:
    """GPUs this machine offers without importing torch: the entries of CUDA_VISIBLE_DEVICES when
    set, else the NVIDIA device nodes /dev/nvidia<N>."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    return len([p for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])
