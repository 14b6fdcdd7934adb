"""The placement refuses every layout NCCL, the SGLang/vLLM servers or CUDA IPC would refuse (issue 23,
items 2, 6, 7): every shipped preset on 1x1, 1x8, 2x8 and 16x8 GPUs, as shipped and scaled to fill the
cluster, under the default and a shifted parent CUDA_VISIBLE_DEVICES.

The expected outcome (placed or refused) and the invariants are computed here from the config alone,
not by the placement's own helpers:
- no two ranks of one NCCL group on one GPU (NCCL ``src/init.cc``: "Duplicate GPU detected : rank %d
  and rank %d both on CUDA device %lx" -> ncclInvalidUsage). The groups: the trainer ranks (FSDP2 over
  NCCL), trainer rank 0 + every rollout worker for each ``tensor_channel`` that is ``nccl``, and a
  rollout worker + each server it owns when the worker's own backend choice for that group is NCCL;
- no trainer rank on a server's GPU (the server takes ``mem_fraction_static`` of it);
- every GPU id inside the parent's CUDA_VISIBLE_DEVICES, and each trainer sees exactly one GPU with
  ``LOCAL_RANK=0`` (torch 2.13 ``device_mesh.py`` sets ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_async.app.workers.rollout_worker import server_group_backend_of
from areal_async.config import ConfigError, load_config
from areal_async.supervisor.placement import PlacementError, place, shape_of

PRESETS = sorted(p.name for p in Path("configs").glob("*.yaml"))
SHAPES = [(1, 1), (1, 8), (2, 8), (16, 8)]
SERVER = ("sglang", "vllm")


def preset(name: str, nodes: int, gpn: int, scaled: bool):
    over = [f"cluster.n_nodes={nodes}", f"cluster.n_gpus_per_node={gpn}", "cluster.device=cuda"]
    # the CPU presets' one-machine knobs (issue 41's smollm2 presets): off, as a GPU cluster would set them
    over += ["cluster.share_cores=false", "evaluator.freq_steps=0"]
    cfg = load_config(f"configs/{name}", over)
    if scaled:  # servers fill node 0 (one worker each), the trainer ranks take every other GPU
        d = min(gpn, nodes * gpn // 2)
        if cfg.rollout.backend.startswith(SERVER):
            over += [f"rollout.backend={cfg.rollout.backend.split(':')[0]}:d{d}", f"cluster.n_rollout_workers={d}"]
            over += [f"cluster.n_trainer_ranks={nodes * gpn - d}"]
        else:
            over += [f"cluster.n_rollout_workers={d}", f"cluster.n_trainer_ranks={nodes * gpn - d}"]
        cfg = load_config(f"configs/{name}", over)
    return cfg


def expected_fit(cfg) -> bool:
    """Whether the cluster can hold the run, from the config's numbers alone."""
    cl, b = cfg.cluster, cfg.rollout.backend
    workers, ranks, per_node = cl.n_rollout_workers, cl.n_trainer_ranks, cl.n_gpus_per_node
    colocate = cfg.tensor_channel.weights == "cuda_ipc"
    if b.startswith(SERVER):
        servers = int(b.split(":d")[1]) if ":d" in b else workers
        return servers + ranks <= cl.n_nodes * per_node and servers <= per_node and servers % workers == 0
    rollout = 0 if colocate else workers
    return rollout + ranks <= cl.n_nodes * per_node and (not colocate or cfg.tensor_channel.trajectories != "nccl")


def assert_invariants(p: dict, cfg, visible: tuple[int, ...]) -> None:
    allowed = set(visible or range(cfg.cluster.n_gpus_per_node))
    on = {w: {(s.node, g) for g in s.physical} for w, s in p.items()}
    first = {w: (s.node, s.physical[0]) for w, s in p.items() if s.physical}
    trainers = ["trainer"] + [f"trainer-{r}" for r in range(1, cfg.cluster.n_trainer_ranks)]
    rollout = [f"rollout-{i}" for i in range(cfg.cluster.n_rollout_workers)]
    servers = sorted((w for w in p if w.startswith(SERVER)), key=lambda w: int(w.split("-")[1]))
    assert all(set(s.physical) <= allowed for s in p.values()), "a GPU outside the parent's CUDA_VISIBLE_DEVICES"
    assert all(len(p[t].physical) == 1 and p[t].env()["LOCAL_RANK"] == "0" for t in trainers)
    groups = [trainers] if len(trainers) > 1 else []
    groups += [["trainer", *rollout] for c in ("weights", "trajectories") if getattr(cfg.tensor_channel, c) == "nccl"]
    for j, srv in enumerate(servers):
        owner = rollout[j % len(rollout)]
        backend = server_group_backend_of(cfg, owner, j // len(rollout), j % len(rollout))  # the worker's own choice
        assert backend in ("gloo", "nccl")
        if backend == "nccl":
            groups.append([owner, srv])
        assert backend == "gloo" or first[owner] not in on[srv], f"{owner} and {srv} share a GPU in an NCCL group"
    for g in groups:
        assert len({first[w] for w in g}) == len(g), f"two ranks of NCCL group {g} on one GPU"
    server_gpus = set().union(*(on[s] for s in servers)) if servers else set()
    assert not any(first[t] in server_gpus for t in trainers), "a trainer rank on a server's GPU"


# (nodes, GPUs per node, scaled): every shape shipped and scaled, but one GPU scaled (nothing to scale there:
# the shipped case covers it)
CASES = [(n, g, scaled) for n, g in SHAPES for scaled in (False, True) if not (scaled and n * g == 1)]


@pytest.mark.parametrize(
    "nodes, gpn, scaled", CASES, ids=[f"{n}x{g}-{'scaled' if s else 'shipped'}" for n, g, s in CASES]
)
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_placed_within_the_rules_or_refused(name, nodes, gpn, scaled):
    try:
        cfg = preset(name, nodes, gpn, scaled)
    except ConfigError as e:  # refused before placement, by the config's own fleet check
        assert "n_gpus_per_node" in str(e), e
        return
    for visible in ((), tuple(range(gpn, 2 * gpn))[::-1]):  # unset, and a parent list such as 15..8
        environ = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, visible))} if visible else {}
        if not expected_fit(cfg):
            with pytest.raises(PlacementError):
                place(shape_of(cfg, environ))
            continue
        assert_invariants(place(shape_of(cfg, environ)), cfg, visible)


def test_the_gpu_presets_as_shipped_fill_one_node_of_eight():
    for name in ("boba_grpo.yaml", "gsm8k_grpo.yaml"):
        p = place(shape_of(load_config(f"configs/{name}"), {}))
        assert [p[f"sglang-{j}"].physical for j in range(4)] == [(j,) for j in range(4)]
        assert [p[f"rollout-{i}"].physical for i in range(4)] == [(i,) for i in range(4)]  # beside its server
        assert [p[t].physical for t in ("trainer", "trainer-1", "trainer-2", "trainer-3")] == [(4,), (5,), (6,), (7,)]
