"""FSDP2 on one GPU: the sharded step equals the plain step (also above ``logits_chunk_tokens`` with gradient
checkpointing, and for a LoRA adapter), the shards publish the same bytes, and a DCP checkpoint round trip with
an HF export that transformers loads back.

``fsdp2_chunked_checkpointing``: micro-batches of 256 tokens with ``logits_chunk_tokens`` 32, so the head runs in
chunks through the FSDP root (``packing._through_root``, counted), and ``gradient_checkpointing`` on; against the
plain step with whole logits and no checkpointing. ``fsdp2_lora_step``: the same with a rank-4 adapter on
q_proj/v_proj (``models.lora.inject``): the adapter's update against the plain step's, the base frozen.

Each check runs in its own process (the runner spawns it) in a one-rank trainer group joined with
``trainer_backend(dev)`` ("cpu:gloo,cuda:nccl" on CUDA, as a run does). CPU twins: ``dev="cpu"`` (gloo),
which is how these checks were tried in the session that wrote them (no GPU was lent).

Thresholds (issue 23): fp32 compute - the fraction of parameter elements whose update differs from the plain
step's by more than 1e-3 * lr is below 1e-3; bf16 compute - the cosine between its update and the plain
update is above 0.8; and most elements moved at all (so the comparison is not of two zero updates).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_async.models import lora
from areal_async.trainer.compute import packing
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.dp import DataParallel, full_tensor, trainer_backend
from areal_async.trainer.compute.packing import select_attn_implementation
from areal_async.trainer.persist.sharded_ckpt import export_full, load_shards, save_shards
from protocols.trajectories import Trajectory
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


CHUNK = 32  # logits_chunk_tokens of the chunked check: micro-batches of 256 tokens go through the head in 8 chunks
LORA = lora.LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def long_trajectories() -> list[Trajectory]:
    """16 sequences of 16 tokens (3 prompt + 13 output): one micro-batch of 256 tokens, > CHUNK."""
    return [
        Trajectory(
            f"s{i}",
            f"g{i // 4}",
            [1, 2, 3 + i % 3],
            [(4 + 7 * i + j) % 60 + 2 for j in range(13)],
            [-4.0] * 13,
            [0] * 13,
            float(i % 2),
        )  # fmt: skip
        for i in range(16)
    ]


def _variant_actor(dev: str, compute_dtype, dp: DataParallel, fused: bool, adapter: bool) -> PPOActor:
    """The tiny model (with a LoRA adapter when ``adapter``); ``fused``: chunked head + gradient checkpointing."""
    model = tiny_model(0)
    if adapter:
        lora.inject(model, LORA, seed=0)
    model.set_attn_implementation(select_attn_implementation(dev, compute_dtype or torch.float32))
    cfg = ActorConfig(
        optimizer=OptimizerConfig(lr=LR),
        mb_spec=MicroBatchSpec(256),
        logits_chunk_tokens=CHUNK if fused else 0,
        logits_whole_max_mb=0,  # chunk whatever the whole logits' size (a real model's vocabulary would)
        gradient_checkpointing=fused,
    )
    return PPOActor(model, cfg, 1.0, 10, device=dev, dp=dp, compute_dtype=compute_dtype)


def _variant_update(dev: str, compute_dtype, dp: DataParallel, fused: bool, adapter: bool, before: dict):
    a = _variant_actor(dev, compute_dtype, dp, fused, adapter)
    a.train_step(long_trajectories())
    after = full_cpu(a.model)
    return {k: after[k] - before[k] for k in before}, a


def _before(adapter: bool) -> dict:
    model = tiny_model(0)
    if adapter:
        lora.inject(model, LORA, seed=0)
    return full_cpu(model)


@contextlib.contextmanager
def _counting_through_root():
    """Count the FSDP root's chunked-head forwards (``packing._through_root``) inside the block."""
    calls, real = [], packing._through_root

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    packing._through_root = counted
    try:
        yield calls
    finally:
        packing._through_root = real


def _fused_vs_plain(dev: str, adapter: bool) -> tuple[dict, dict]:
    """(updates by variant, facts) of the plain step and the FSDP2 fp32/bf16 steps with the chunked head and
    checkpointing; for a LoRA run the updates are the adapter's and the base's moves are reported."""
    backend = one_rank_group(dev)
    try:
        before = _before(adapter)
        plain, _ = _variant_update(dev, None, DataParallel.single(), False, adapter, before)
        with _counting_through_root() as calls:
            fp32, a = _variant_update(dev, torch.float32, DataParallel(0, 1), True, adapter, before)
            bf16, _ = _variant_update(dev, torch.bfloat16, DataParallel(0, 1), True, adapter, before)
        facts = {
            "backend": backend,
            "chunked_head_calls": len(calls),
            "checkpointing": _checkpointing(a.model),
        }
    finally:
        dist.destroy_process_group()
    return {"plain": plain, "fp32": fp32, "bf16": bf16}, facts


def _judge(updates: dict, keys: list[str], facts: dict) -> Result:
    """The thresholds of ``fsdp2_step_vs_plain`` over ``keys``; the chunked head and checkpointing must have run."""
    flat = {v: torch.cat([u[k].reshape(-1) for k in keys]) for v, u in updates.items()}
    frac = float(((flat["plain"] - flat["fp32"]).abs() > 1e-3 * LR).float().mean())
    cos = float(torch.nn.functional.cosine_similarity(flat["plain"], flat["bf16"], dim=0))
    moved = float((flat["plain"] != 0).float().mean())
    data = facts | {"fp32_frac_off": frac, "bf16_cos": cos, "moved": moved, "tensors": len(keys)}
    ok = frac < 1e-3 and cos > 0.8 and moved > 0.3 and facts["chunked_head_calls"] > 0 and facts["checkpointing"]
    detail = (
        f"fp32: {frac:.1e} of elements off by > 1e-3*lr; bf16: cos {cos:.4f}; {moved:.0%} moved; chunked head "
        f"through the FSDP root {facts['chunked_head_calls']}x; checkpointing {facts['checkpointing']}"
    )
    return Result(ok, detail, data)


def fsdp2_chunked_checkpointing(dev: str) -> Result:
    updates, facts = _fused_vs_plain(dev, adapter=False)
    return _judge(updates, sorted(updates["plain"]), facts)


def fsdp2_lora_step(dev: str) -> Result:
    """The adapter's update matches; the base weights do not move in any variant."""
    updates, facts = _fused_vs_plain(dev, adapter=True)
    keys = sorted(k for k in updates["plain"] if _adapter(k))
    base_moved = {v: max(float(u[k].abs().max()) for k in u if not _adapter(k)) for v, u in updates.items()}
    res = _judge(updates, keys, facts | {"base_max_move": base_moved})
    if any(m != 0 for m in base_moved.values()) or not keys:
        return Result(False, f"the frozen base moved {base_moved} (or no adapter: {len(keys)} tensors)", res.data)
    return res


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether HF's activation checkpointing is on (transformers 5's name, else the older one)."""
    return bool(
        getattr(model, "is_activation_checkpointing", None) or getattr(model, "is_gradient_checkpointing", False)
    )


def _adapter(name: str) -> bool:
    """A LoRA tensor's state-dict name (``...q_proj.lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name
