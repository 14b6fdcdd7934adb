"""GPU trainer check (marked ``gpu``; run by ``scripts/gpu_check.sh``): one FSDP2 PPO step on one
GPU over NCCL with bf16 compute and float32 master weights and Adam state.

Written against torch's FSDP2 / NCCL API and the CPU twin (tests/contract/test_trainer_dp.py); not run in
the session that wrote it (no GPU was lent).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytest.importorskip("zmq", reason="protocols.sockets needs pyzmq (see scripts/gpu_check.sh)")
pytest.importorskip("msgpack", reason="the project's modules need msgpack (see scripts/gpu_check.sh)")

from protocols.sockets import free_tcp_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _step(port: int, out_path: str) -> None:
    import torch.distributed as dist

    from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_async.trainer.actor import PPOActor
    from areal_async.trainer.compute.dp import DataParallel, full_tensor, trainer_backend
    from areal_async.trainer.compute.packing import select_attn_implementation
    from protocols.trajectories import Trajectory
    from benchmarks.gpu_check.models import tiny_model

    torch.cuda.set_device(0)
    dist.init_process_group(trainer_backend("cuda"), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = tiny_model(0)
    model.set_attn_implementation(select_attn_implementation("cuda", torch.bfloat16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    actor = PPOActor(
        model,
        ActorConfig(optimizer=OptimizerConfig(lr=1e-6), mb_spec=MicroBatchSpec(256)),
        1.0,
        10,
        device="cuda",
        dp=DataParallel(0, 1),
        compute_dtype=torch.bfloat16,
    )
    seen = []
    actor.model.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    trajs = [
        Trajectory(f"s{i}", f"g{i // 2}", [1, 2, 3], [4 + i, 5, 6, 7], [-4.0] * 4, [0] * 4, float(i % 2))
        for i in range(8)
    ]
    m = actor.train_step(trajs)
    after = {k: full_tensor(v).detach().cpu() for k, v in actor.model.state_dict().items()}
    k = "model.layers.0.mlp.up_proj.weight"
    big = before[k].abs() > 1 / 128
    torch.save(
        {
            "moved": float(((after[k] - before[k])[big] != 0).float().mean()),
            "dtype": str(after[k].dtype),
            "compute": sorted({str(d) for d in seen}),
            "grad_norm": m["grad_norm"],
            "opt": sorted({str(s["exp_avg"].dtype) for s in actor.optimizer.state.values()}),
        },
        out_path,
    )
    dist.destroy_process_group()


def test_one_gpu_fsdp_step_bf16_compute_fp32_master(tmp_path):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_step, args=(free_tcp_port("127.0.0.1"), str(tmp_path / "gpu_step.pt")))
    p.start()
    p.join(timeout=300)
    assert p.exitcode == 0
    got = torch.load(tmp_path / "gpu_step.pt", weights_only=True)
    assert got["compute"] == ["torch.bfloat16"] and got["dtype"] == "torch.float32"
    assert got["opt"] == ["torch.float32"] and got["grad_norm"] == got["grad_norm"]
    assert got["moved"] > 0.9  # a 1e-6 step that bf16 weights would round away
