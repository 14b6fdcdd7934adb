"""FSDP2 on one GPU: the sharded step equals the plain step, the shards publish the same bytes, and a DCP
checkpoint round trip with an HF export that transformers loads back.

Each check runs in its own process (the runner spawns it) in a one-rank trainer group joined with
``trainer_backend(dev)`` ("cpu:gloo,cuda:nccl" on CUDA, as a run does). CPU twins: ``dev="cpu"`` (gloo),
which is how these checks were tried in the session that wrote them (no GPU was lent).

Thresholds (issue 23): fp32 compute - the fraction of parameter elements whose update differs from the plain
step's by more than 1e-3 * lr is below 1e-3; bf16 compute - the cosine between its update and the plain
update is above 0.8; and most elements moved at all (so the comparison is not of two zero updates).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.dp import DataParallel, full_tensor, trainer_backend
from areal_async.trainer.packing import select_attn_implementation
from areal_async.trainer.sharded_ckpt import export_full, load_shards, save_shards
from areal_async.trainer.types import Trajectory
from areal_async.transport import buckets as B
from benchmarks.gpu_check.models import tiny_model
from benchmarks.gpu_check.registry import Result
from protocols.ports import free_tcp_port

LR = 1e-4


def trajectories() -> list[Trajectory]:
    return [
        Trajectory(
            f"s{i}", f"g{i // 4}", [1, 2, 3 + i % 3], [4 + i, 5, 6, 7 + i % 5, 9], [-4.0] * 5, [0] * 5, float(i % 2)
        )
        for i in range(16)
    ]


def actor(dev: str, compute_dtype, dp: DataParallel) -> PPOActor:
    model = tiny_model(0)
    model.set_attn_implementation(select_attn_implementation(dev, compute_dtype or torch.float32))
    cfg = ActorConfig(optimizer=OptimizerConfig(lr=LR), mb_spec=MicroBatchSpec(64))
    return PPOActor(model, cfg, 1.0, 10, device=dev, dp=dp, compute_dtype=compute_dtype)


def full_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v).detach().float().cpu() for k, v in model.state_dict().items()}


def one_rank_group(dev: str) -> str:
    backend = trainer_backend(dev)
    if dev == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_tcp_port('127.0.0.1')}", rank=0, world_size=1)
    return backend


def _update(dev: str, compute_dtype, dp: DataParallel, before: dict) -> tuple[torch.Tensor, dict, PPOActor]:
    a = actor(dev, compute_dtype, dp)
    m = a.train_step(trajectories())
    after = full_cpu(a.model)
    return torch.cat([(after[k] - before[k]).reshape(-1) for k in before]), m, a


def fsdp2_step_vs_plain(dev: str) -> Result:
    backend = one_rank_group(dev)
    try:
        before = full_cpu(tiny_model(0))
        plain, m_plain, _ = _update(dev, None, DataParallel.single(), before)
        fp32, m_fp32, _ = _update(dev, torch.float32, DataParallel(0, 1), before)
        bf16, _, a_bf16 = _update(dev, torch.bfloat16, DataParallel(0, 1), before)
        same_bytes = _sharded_publish_matches(a_bf16)
    finally:
        dist.destroy_process_group()
    frac = float(((plain - fp32).abs() > 1e-3 * LR).float().mean())
    cos = float(torch.nn.functional.cosine_similarity(plain, bf16, dim=0))
    moved = float((plain != 0).float().mean())
    data = {
        "backend": backend,
        "fp32_frac_off": frac,
        "bf16_cos": cos,
        "moved": moved,
        "grad_norm": {"plain": m_plain["grad_norm"], "fsdp_fp32": m_fp32["grad_norm"]},
        "sharded_publish_bytes_equal": same_bytes,
    }
    ok = frac < 1e-3 and cos > 0.8 and moved > 0.5 and same_bytes
    return Result(
        ok,
        f"fp32: {frac:.1e} of elements off by > 1e-3*lr (< 1e-3); bf16: cos {cos:.4f} (> 0.8); "
        f"{moved:.0%} moved; sharded publish bytes equal: {same_bytes}",
        data,
    )


def _sharded_publish_matches(a: PPOActor, bucket: int = 64 << 10) -> bool:
    """The FSDP2 shards packed bucket by bucket (``ShardedWeights``) are byte-equal, checksums too, to the
    gathered state packed on the host."""
    sd = a.publish_state(torch.bfloat16, bucket)
    ref = {k: v.to(torch.bfloat16) for k, v in full_cpu(a.model).items()}
    lay = B.plan(sd, bucket)
    same = True
    for k, n in enumerate(lay.bucket_sizes):
        dev_buf = torch.empty(n, dtype=torch.uint8, device=a.device)
        host_buf = torch.empty(n, dtype=torch.uint8)
        B.pack(lay, sd, k, dev_buf)
        B.pack(lay, ref, k, host_buf)
        same &= torch.equal(dev_buf.cpu(), host_buf) and B.checksum(dev_buf, "sum64") == B.checksum(host_buf, "sum64")
    sd.finish()
    return bool(same)


def dcp_roundtrip_hf_export(dev: str) -> Result:
    """bf16 FSDP2 actor after one step: DCP save, weights zeroed, DCP load gives the same weights; the HF
    export loads with transformers (architecture as built, weights equal to the bf16 of the master weights)."""
    one_rank_group(dev)
    d = tempfile.mkdtemp(prefix="gpu-check-dcp-")
    try:
        a = actor(dev, torch.bfloat16, DataParallel(0, 1))
        a.train_step(trajectories())
        want = full_cpu(a.model)
        save_shards(d, a.model, a.optimizer)
        export_full(d, a.model, torch.bfloat16, 0)
        with torch.no_grad():
            for p in a.model.parameters():
                p.zero_()
        load_shards(d, a.model, a.optimizer)
        got = full_cpu(a.model)
    finally:
        dist.destroy_process_group()
    try:
        same = all(torch.equal(want[k], got[k]) for k in want)
        arch = json.loads((Path(d) / "config.json").read_text()).get("architectures")
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).state_dict()  # the export's own dtype
        hf_equal = all(torch.equal(hf[k].float(), want[k].to(torch.bfloat16).float()) for k in want)
        files = sorted(os.listdir(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    data = {"weights_equal": same, "architectures": arch, "hf_equal": hf_equal, "files": files}
    ok = same and arch == ["LlamaForCausalLM"] and hf_equal
    return Result(ok, f"DCP round trip equal: {same}; HF export {arch}, loaded weights equal: {hf_equal}", data)
