"""The tensor channels of a rollout worker and the trainer, as ``tensor_channel.*`` configures them."""

from __future__ import annotations

from areal_async.base.manifest import RunManifest
from areal_async.config import ExperimentConfig
from areal_async.transport import make_tensor_channel, make_weight_channel


def _group(cfg: ExperimentConfig, kind: str, rank: int, store: str) -> dict:
    """Rank/world/store for the collective kinds (rank 0 = trainer, 1..N = rollout workers)."""
    if kind not in ("gloo", "nccl"):
        return {}
    return {"rank": rank, "world_size": cfg.cluster.n_rollout_workers + 1, "store": store}


def trajectory_channel(cfg: ExperimentConfig, ep: RunManifest, role: str, rank: int):
    kind = cfg.tensor_channel.trajectories
    kw = {"run_id": ep.run_id} if kind == "shm" else {}
    if role == "receiver" and kind in ("zmq", "gloo", "nccl"):  # the trainer's bound on one group's tensors
        kw["max_message_bytes"] = int(cfg.tensor_channel.max_message_mb * 2**20)
    return make_tensor_channel(
        kind, role=role, endpoint=ep.trajectories, **kw, **_group(cfg, kind, rank, ep.traj_store)
    )


def weight_channel(cfg: ExperimentConfig, ep: RunManifest, role: str, rank: int):
    kind = cfg.tensor_channel.weights
    kw = {"run_id": ep.run_id} if kind == "shm" else {}
    if role == "publisher":
        kw["bucket_mb"] = cfg.tensor_channel.bucket_mb
        if kind == "zmq":
            kw["endpoint"] = ep.weights_endpoint
    if kind == "cuda_ipc":  # one IPC reference per receiver (transport/cuda_ipc.py)
        kw |= {"n_receivers": cfg.cluster.n_rollout_workers} if role == "publisher" else {"rank": rank}
    group = _group(cfg, kind, rank, ep.weight_store)
    return make_weight_channel(kind, role=role, delta=cfg.tensor_channel.weight_delta, **kw, **group)
