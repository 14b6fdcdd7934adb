"""Which devices each process gets: pure functions from the cluster's shape to a placement.

The cluster is ``n_nodes`` machines of ``n_gpus_per_node`` GPUs. GPUs are numbered globally,
node by node (global g is GPU ``g % n_gpus_per_node`` of node ``g // n_gpus_per_node``), and
handed out in one pass:

    global GPUs  [ rollout 0 | rollout 1 | ... | trainer rank 0 | trainer rank 1 | ... | unused ]

- servers the supervisor starts (``sglang:dN`` / ``vllm:dN``): server ``j`` (``sglang-j``) on
  rollout GPU ``j``, all on node 0 (``servers.plan_server_addresses`` starts them there); rollout
  worker ``i`` sees the GPUs of the servers it owns (``remote.servers_of``: ``j = i mod W``);
  attached servers (``sglang.addresses``): the rollout GPUs are shared evenly over the workers;
  the embedded ``torch`` engine on CUDA: one GPU per worker;
- every trainer rank gets exactly one GPU (NCCL refuses two ranks on one device);
- the scheduler and reward workers get none (``CUDA_VISIBLE_DEVICES=""``).

Node-local GPU ``k`` is the parent's ``CUDA_VISIBLE_DEVICES[k]`` when the supervisor runs under one
(``4,5,6,7`` from Slurm: the processes get 4..7; ``Slot.devices``); every process and server gets
its own ``CUDA_VISIBLE_DEVICES`` (servers start with ``--base-gpu-id 0`` inside it), so nothing
reads the parent's list a second time. ``LOCAL_RANK`` is ``0``: the device index inside a process
that sees one GPU (torch 2.13 ``device_mesh.py`` ``_setup_world_group_and_device`` calls
``set_device(int(LOCAL_RANK))``; the node-local rank there is an invalid ordinal). ``Slot.local_rank``
keeps the index among the trainer ranks of a node, for the record.

Weight paths (items 2 of issue 23 and 5 of issue 36): a rollout worker relays the trainer's weights to
the servers it owns and shares their GPUs, so its server group cannot be NCCL (NCCL ``init.cc``: two
ranks of one communicator on one GPU fail "Duplicate GPU detected ... ncclInvalidUsage"):
``server_group_backend`` makes it gloo (SGLang receives a gloo broadcast into its CUDA tensor). The GPU
presets take the trainer's weights and the trajectories over shm (``weight_path.py`` says why: nothing of
the worker's on the server's GPU); NCCL trainer→rollout channels, where chosen, join trainer rank 0 with
every rollout worker, each on its own GPU, and the preflight checks what they put beside the server.
``tensor_channel.weights: cuda_ipc`` colocates instead: every rollout worker on
trainer rank 0's GPU (the only layout where the receiver can open the sender's memory), which is
also the 1-GPU layout (torch engine + one trainer rank on GPU 0; trajectories over zmq/shm).

Refusals (``PlacementError``, before anything starts; ``check_layout`` re-checks every result from
the groups alone): more GPUs asked than the cluster or the parent's ``CUDA_VISIBLE_DEVICES`` has;
rollout GPUs that do not divide over the rollout workers; a process whose GPUs would span nodes;
two ranks of one NCCL group on one GPU; a trainer rank on a server's GPU; a cuda_ipc receiver on
another GPU than the sender; a machine that has fewer GPUs than the node asks of it
(``check_gpus_present``). None of this has run on a GPU yet: the rules are read from NCCL, torch
and SGLang sources and checked on CPU (tests/unit/supervisor/test_placement.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_async.config import ExperimentConfig, n_servers, rollout_dp_degree, server_addresses

DUPLICATE_GPU = "NCCL init.cc: 'Duplicate GPU detected' (ncclInvalidUsage)"


class PlacementError(ValueError):
    """The cluster cannot hold the processes as asked; the message names the numbers."""


@dataclass(frozen=True)
class Slot:
    """The devices of one process: node-local GPU indices and the physical ids they map to."""

    node: int
    gpus: tuple[int, ...] = ()  # node-local GPU indices (positions in the node's visible list)
    local_rank: Optional[int] = None  # trainer ranks only: index among the trainer ranks of the node
    devices: Optional[tuple[int, ...]] = None  # physical ids (CUDA_VISIBLE_DEVICES); None = same as gpus

    @property
    def physical(self) -> tuple[int, ...]:
        return self.gpus if self.devices is None else self.devices

    def env(self) -> dict[str, str]:
        """Environment variables this process starts with (GPU runs only)."""
        out = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.physical)}
        if self.local_rank is not None:
            out["LOCAL_RANK"] = "0"  # its one GPU is cuda:0 inside the process
        return out

    def as_dict(self) -> dict:
        return {"node": self.node, "gpus": list(self.physical), "local_rank": self.local_rank}


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
    servers: str = ""  # "sglang" / "vllm" when the supervisor starts rollout_gpus servers, one GPU each
    visible: tuple[int, ...] = ()  # the parent's CUDA_VISIBLE_DEVICES (physical ids); () = 0..n_gpus_per_node-1
    nccl_channels: tuple[str, ...] = ()  # "weights", "trajectories": trainer rank 0 + rollout workers over NCCL
    colocate: bool = False  # a cuda_ipc tensor channel: rollout workers on trainer rank 0's GPU


def rollout_gpu_count(backend: str, device: str, n_rollout_workers: int, dp_degree: int, colocate=False) -> int:
    """GPUs of the rollout fleet: dN for the server backends (``sglang:dN``, ``vllm:dN``), one per
    worker for ``torch`` on CUDA, none when the torch engines colocate with trainer rank 0."""
    if device != "cuda":
        return 0
    if backend.startswith(("sglang", "vllm")):
        return dp_degree
    return 0 if colocate else n_rollout_workers


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
    """Worker id -> Slot for every process (and started server) of the run; see the module docstring."""
    if shape.n_trainer_ranks < 1:
        raise PlacementError(f"cluster.n_trainer_ranks={shape.n_trainer_ranks}: expected an integer >= 1")
    rollout = [f"rollout-{i}" for i in range(shape.n_rollout_workers)]
    trainers = trainer_names(shape.n_trainer_ranks)
    if shape.device != "cuda":
        return _deal_cpu(list(shape.extra_workers), trainers, rollout, shape.n_nodes)
    visible = _visible(shape)
    _check_total(shape)
    out = {w: Slot(node=0) for w in shape.extra_workers}
    out |= _place_servers(shape, rollout) if shape.servers else _place_engines(shape, rollout)
    pos, per_node, locals_on = shape.rollout_gpus, shape.n_gpus_per_node, {}
    for w in trainers:
        node, gpus = _take(pos, 1, per_node, w)
        out[w], pos = Slot(node, gpus, local_rank=locals_on.get(node, 0)), pos + 1
        locals_on[node] = locals_on.get(node, 0) + 1
    if shape.colocate:  # cuda_ipc: every rollout worker on trainer rank 0's GPU
        out |= {w: Slot(out["trainer"].node, out["trainer"].gpus) for w in rollout}
    out = {w: _mapped(s, visible) for w, s in out.items()}
    check_layout(out, shape)
    return out


def _mapped(slot: Slot, visible: tuple[int, ...]) -> Slot:
    """The slot with its physical GPU ids (left None where they equal the local indices)."""
    phys = tuple(visible[g] for g in slot.gpus)
    return Slot(slot.node, slot.gpus, slot.local_rank, None if phys == slot.gpus else phys)


def _place_servers(shape: ClusterShape, rollout: list[str]) -> dict[str, Slot]:
    """Server j on rollout GPU j of node 0; worker i on the GPUs of its servers j = i mod W."""
    if shape.rollout_gpus > shape.n_gpus_per_node:
        raise PlacementError(
            f"{shape.servers}:d{shape.rollout_gpus} starts {shape.rollout_gpus} servers, one GPU each, on node 0 "
            f"(servers.plan_server_addresses) but a node has cluster.n_gpus_per_node={shape.n_gpus_per_node}; "
            f"start at most {shape.n_gpus_per_node} or attach servers on other nodes ({shape.servers}.addresses)"
        )
    out = {f"{shape.servers}-{j}": Slot(0, (j,)) for j in range(shape.rollout_gpus)}
    if not shape.colocate:
        w = len(rollout)
        out |= {r: Slot(0, tuple(range(i, shape.rollout_gpus, w))) for i, r in enumerate(rollout)}
    return out


def _place_engines(shape: ClusterShape, rollout: list[str]) -> dict[str, Slot]:
    """The rollout GPUs shared evenly over the workers (torch engines, or attached servers)."""
    if shape.colocate:
        return {}
    per_worker = shape.rollout_gpus // max(1, shape.n_rollout_workers)
    out, pos = {}, 0
    for w in rollout:
        node, gpus = _take(pos, per_worker, shape.n_gpus_per_node, w)
        out[w], pos = Slot(node, gpus), pos + per_worker
    return out


def _visible(shape: ClusterShape) -> tuple[int, ...]:
    if not shape.visible:
        return tuple(range(shape.n_gpus_per_node))
    if len(shape.visible) < shape.n_gpus_per_node or len(set(shape.visible)) != len(shape.visible):
        raise PlacementError(
            f"cluster.n_gpus_per_node={shape.n_gpus_per_node} but the supervisor's CUDA_VISIBLE_DEVICES="
            f"{','.join(map(str, shape.visible))} names {len(set(shape.visible))} distinct GPUs; "
            "lower cluster.n_gpus_per_node or widen CUDA_VISIBLE_DEVICES"
        )
    return shape.visible[: shape.n_gpus_per_node]


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
            f"{shape.n_gpus_per_node} = {total}" + _one_gpu_hint(shape, total)
        )
    if shape.colocate:
        return
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


def _one_gpu_hint(shape: ClusterShape, total: int) -> str:
    if total != 1:
        return ""
    if shape.servers:
        return (
            f"; on one GPU a {shape.servers} server and a trainer rank cannot share the device (the server "
            "reserves its memory fraction and the trainer's ranks may not sit on a server's GPU): use "
            "rollout.backend=torch with tensor_channel.weights=cuda_ipc (colocated) or a bigger machine"
        )
    return "; the 1-GPU layout colocates: tensor_channel.weights=cuda_ipc, trajectories zmq or shm, one trainer rank"


def nccl_groups(placement: dict[str, Slot], shape: ClusterShape) -> dict[str, list[str]]:
    """Every NCCL communicator of the run: group name -> its ranks' worker ids."""
    trainers = [w for w in placement if w == "trainer" or w.startswith("trainer-")]
    rollout = [w for w in placement if w.startswith("rollout-")]
    out = {"trainer-dp": trainers} if len(trainers) > 1 else {}
    out |= {f"{c}-channel": ["trainer", *rollout] for c in shape.nccl_channels}
    for j in range(shape.rollout_gpus if shape.servers else 0):
        owner, server = f"rollout-{j % max(1, len(rollout))}", f"{shape.servers}-{j}"
        if server_group_backend(placement[owner], placement[server]) == "nccl":
            out[f"{server}-weights"] = [owner, server]
    return out


def server_group_backend(worker: Slot, server: Slot) -> str:
    """The weight group of a rollout worker and a server it owns: NCCL only when the worker's GPU
    (its cuda:0) is none of the server's; gloo otherwise (SGLang's InitWeightsUpdateGroupReqInput
    takes a backend, and its receive tensor is on CUDA, which gloo broadcasts handle)."""
    if not worker.physical or (worker.node == server.node and worker.physical[0] in server.physical):
        return "gloo"
    return "nccl"


def check_layout(placement: dict[str, Slot], shape: ClusterShape) -> None:
    """PlacementError for a layout NCCL, the servers or CUDA IPC would refuse (see the module docstring)."""
    for name, ranks in nccl_groups(placement, shape).items():
        seen: dict[tuple[int, int], str] = {}
        for w in ranks:
            dev = (placement[w].node, placement[w].physical[0])
            if dev in seen:
                raise PlacementError(
                    f"NCCL group {name!r} would have {seen[dev]} and {w} on GPU {dev[1]} of node {dev[0]}: "
                    f"{DUPLICATE_GPU}; use a zmq/shm/gloo channel or more GPUs"
                )
            seen[dev] = w
    servers = {(s.node, g): w for w, s in placement.items() if w.startswith(("sglang-", "vllm-")) for g in s.physical}
    for w, s in placement.items():
        if w.startswith("trainer") and (s.node, s.physical[0]) in servers:
            raise PlacementError(f"{w} would share GPU {s.physical[0]} with {servers[(s.node, s.physical[0])]}")
    if shape.colocate:
        t0 = placement["trainer"]
        for w, s in placement.items():
            if w.startswith("rollout-") and (s.node, s.physical[:1]) != (t0.node, t0.physical):
                raise PlacementError(f"cuda_ipc: {w} on GPU {s.physical} cannot open trainer memory on {t0.physical}")


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


def shape_of(cfg: ExperimentConfig, environ: Optional[dict] = None) -> ClusterShape:
    """The placement's view of a run's config (``environ``: the supervisor's, for CUDA_VISIBLE_DEVICES)."""
    cl, tc = cfg.cluster, cfg.tensor_channel
    extra = ("scheduler",) + tuple(f"reward-{i}" for i in range(cl.n_reward_workers))
    backend = cfg.rollout.backend
    colocate = cl.device == "cuda" and "cuda_ipc" in (tc.weights, tc.trajectories)  # receiver beside its sender
    gpus = rollout_gpu_count(backend, cl.device, cl.n_rollout_workers, rollout_dp_degree(backend), colocate)
    started = backend.startswith(("sglang", "vllm")) and not server_addresses(cfg) and cl.device == "cuda"
    return ClusterShape(
        n_nodes=cl.n_nodes,
        n_gpus_per_node=cl.n_gpus_per_node,
        device=cl.device,
        n_trainer_ranks=cl.n_trainer_ranks,
        n_rollout_workers=cl.n_rollout_workers,
        rollout_gpus=n_servers(cfg) if started else gpus,
        extra_workers=extra,
        servers=backend.split(":")[0] if started else "",
        visible=visible_devices(os.environ if environ is None else environ) if cl.device == "cuda" else (),
        nccl_channels=tuple(c for c in ("weights", "trajectories") if getattr(tc, c) == "nccl"),
        colocate=colocate,
    )


def visible_devices(environ: dict) -> tuple[int, ...]:
    """The supervisor's CUDA_VISIBLE_DEVICES as integers; () when unset (every GPU of the node)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return ()  # unset: every GPU of the node; empty: none, which check_gpus_present reports as 0 GPUs here
    items = [v.strip() for v in raw.split(",") if v.strip()]
    if not all(v.isdigit() for v in items):
        raise PlacementError(
            f"CUDA_VISIBLE_DEVICES={raw!r}: the placement maps integer GPU indices; UUID/MIG names are not supported"
        )
    return tuple(int(v) for v in items)


def local_gpu_count(environ: Optional[dict] = None, dev: Path = Path("/dev")) -> int:
    """GPUs this machine offers without importing torch: the entries of CUDA_VISIBLE_DEVICES when
    set, else the NVIDIA device nodes /dev/nvidia<N>."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    return len([p for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def group_report(placement: dict[str, Slot], shape: ClusterShape) -> list[str]:
    """The dry run's account of the devices (YAML comment lines): each server's GPUs, every NCCL group
    with its ranks' node:GPU (physical ids), and each server weight group's backend."""
    out = [
        f"#   {w:<12} node {s.node} GPU {','.join(map(str, s.physical))}"
        for w, s in placement.items()
        if w.startswith(("sglang-", "vllm-"))
    ]
    out.append("# NCCL groups (at most one rank per GPU: NCCL init.cc refuses a duplicate):")
    for name, ranks in nccl_groups(placement, shape).items():
        out.append(f"#   {name}: " + " ".join(f"{w}@{placement[w].node}:{placement[w].physical[0]}" for w in ranks))
    for j in range(shape.rollout_gpus if shape.servers else 0):
        owner, server = f"rollout-{j % shape.n_rollout_workers}", f"{shape.servers}-{j}"
        out.append(
            f"#   {server} weight group with {owner}: {server_group_backend(placement[owner], placement[server])}"
        )
    return out
