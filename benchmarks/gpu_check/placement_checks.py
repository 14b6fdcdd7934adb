"""The placement's refusals over the shipped GPU presets (items 2, 6, 7 of issue 23); pure CPU.

``placement_refusals``: ``configs/boba_grpo.yaml`` and ``configs/gsm8k_grpo.yaml`` as shipped (one node
of 8 GPUs) are placed under an unset and a Slurm-style ``CUDA_VISIBLE_DEVICES`` (8..15), and each result is
checked here from its slots alone: no two ranks of one NCCL group on one GPU (NCCL ``src/init.cc``
"Duplicate GPU detected"), no trainer rank on a server's GPU, every GPU inside the parent's list, each
trainer on one GPU with ``LOCAL_RANK=0``. Then layouts the real systems refuse must be refused: the preset
on one GPU, a parent list shorter than the node, a colocated (cuda_ipc) layout whose trajectories ride
NCCL, a trainer rank moved onto a server's GPU. On the GPU box it also places the presets over the GPUs
that box really shows (its own ``CUDA_VISIBLE_DEVICES``), scaled down to fit when it has fewer than 8.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from areal_async.config import load_config
from areal_async.supervisor.placement import PlacementError, Slot, check_layout, place, shape_of
from benchmarks.gpu_check.registry import Result

PRESETS = ("boba_grpo.yaml", "gsm8k_grpo.yaml")
ROOT = Path(__file__).resolve().parents[2]


def _problems(p: dict, cfg, visible: tuple[int, ...]) -> list[str]:
    allowed = set(visible or range(cfg.cluster.n_gpus_per_node))
    first = {w: (s.node, s.physical[0]) for w, s in p.items() if s.physical}
    trainers = [w for w in p if w == "trainer" or w.startswith("trainer-")]
    rollout = [w for w in p if w.startswith("rollout-")]
    servers = {(s.node, g): w for w, s in p.items() if w.startswith(("sglang-", "vllm-")) for g in s.physical}
    out = [f"{w} on GPU {s.physical} outside {sorted(allowed)}" for w, s in p.items() if not set(s.physical) <= allowed]
    groups = [trainers] + [
        ["trainer", *rollout] for c in ("weights", "trajectories") if getattr(cfg.tensor_channel, c) == "nccl"
    ]
    out += [f"NCCL group {g} has two ranks on one GPU" for g in groups if len({first[w] for w in g}) < len(g)]
    out += [f"{t} on {servers[first[t]]}'s GPU" for t in trainers if first[t] in servers]
    out += [f"{t} sees {p[t].env()}" for t in trainers if p[t].env().get("LOCAL_RANK") != "0" or len(p[t].gpus) != 1]
    return out


def _refused(fn) -> bool:
    try:
        fn()
    except PlacementError:
        return True
    return False


def placement_refusals() -> Result:
    data, bad = {}, []
    for name in PRESETS:
        cfg = load_config(str(ROOT / "configs" / name))
        for visible in ((), tuple(range(8, 16))):
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, visible))} if visible else {}
            p = place(shape_of(cfg, env))
            bad += [f"{name} {env}: {x}" for x in _problems(p, cfg, visible)]
            data[f"{name} {env.get('CUDA_VISIBLE_DEVICES', 'unset')}"] = {w: s.physical for w, s in p.items() if s.gpus}
    cfg = load_config(str(ROOT / "configs" / "boba_grpo.yaml"))
    shape = shape_of(cfg, {})
    refusals = {
        "one GPU": lambda: place(replace(shape, n_gpus_per_node=1)),
        "parent list 4,5,6,7 for 8 GPUs": lambda: place(shape_of(cfg, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})),
        "colocated with NCCL trajectories": lambda: place(
            replace(shape, colocate=True, servers="", rollout_gpus=0, nccl_channels=("trajectories",))
        ),
        "trainer on a server GPU": lambda: check_layout(dict(place(shape), **{"trainer-1": Slot(0, (0,), 1)}), shape),
    }
    missed = [k for k, fn in refusals.items() if not _refused(fn)]
    bad += [f"not refused: {k}" for k in missed]
    data["refused"] = [k for k in refusals if k not in missed]
    data["this box"] = _this_box()
    return Result(
        not bad,
        "; ".join(bad) or f"{len(PRESETS)} presets placed within the rules, {len(refusals)} bad layouts refused",
        data,
    )


def _this_box() -> dict:
    """The presets over the GPUs this machine shows (none here: nothing to place)."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        n = 0
    if n < 2:
        return {"gpus": n, "placed": "needs 2 GPUs: one server and one trainer rank" if n else "no GPU"}
    half = min(4, n // 2)
    over = [
        f"cluster.n_gpus_per_node={2 * half}",
        f"rollout.backend=sglang:d{half}",
        f"cluster.n_rollout_workers={half}",
        f"cluster.n_trainer_ranks={half}",
    ]
    cfg = load_config(str(ROOT / "configs" / "boba_grpo.yaml"), over)
    p = place(shape_of(cfg, dict(os.environ)))
    return {"gpus": n, "placed": {w: s.physical for w, s in p.items() if s.gpus}}
