"""Data-parallel trainer ranks on gloo, the CPU twin of the GPU FSDP2 / NCCL path (tests/gpu/test_gpu_trainer.py):
2 FSDP2 ranks take the 1-rank step; bf16 compute keeps float32 master weights; a LoRA adapter trained and
published alone from the shards. Each test spawns its ranks (fresh interpreters with torch: ~10 s of CPU each),
so they are here, not in the unit tier; the batch split and its trip between ranks are
tests/unit/trainer/test_trainer_dp_batches.py."""

import dataclasses
import multiprocessing as mp

import pytest
import torch
import transformers

from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig, RejectionSamplingConfig
from areal_async.models import lora
from areal_async.models.lora import LoraSpec
from areal_async.trainer.actor import PPOActor
from protocols.sockets import free_tcp_port
from tests.support.trainer_fixtures import make_trajs

torch.set_num_threads(1)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def cfg():
    # Adam eps 0.1 makes the update close to lr * grad (not sign(grad)), so a wrong gradient scale shows
    # kl_ctl > 0: the reference model (sharded too on the ranks) enters the advantages
    return ActorConfig(
        use_decoupled_loss=True,
        recompute_logprob=True,
        reward_scaling=10.0,
        reward_bias=-0.5,
        eps_clip=0.2,
        ppo_n_minibatches=2,
        kl_ctl=0.05,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=24),
        rejection_sampling=RejectionSamplingConfig("ratio", 2.0, "mask"),
        optimizer=OptimizerConfig(lr=1e-2, eps=0.1, gradient_clipping=0.0),
    )


def reference():
    return tiny_model(seed=9)


def _init(rank, world, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _rank_step(rank, world, port, out_dir):
    """On each of 2 FSDP2 ranks (float32 compute): load the 1-rank checkpoint (shards written by
    one process) and compare; one train_step; publish through a real shm weight channel from the
    shards, a bucket at a time; save a 2-rank checkpoint. Rank 0 saves what the test checks."""
    from areal_async.trainer.compute.dp import DataParallel, ShardedWeights, full_tensor
    from areal_async.trainer.persist.sharded_ckpt import load_shards, save_shards
    from areal_async.transport import make_weight_channel

    _init(rank, world, port)
    out = {}
    dp = DataParallel(rank, world)
    resumed = PPOActor(tiny_model(seed=5), cfg(), 1.0, 10, dp=dp, compute_dtype=torch.float32, ref_model=reference)
    load_shards(f"{out_dir}/one_ckpt", resumed.model, resumed.optimizer)
    out["resumed"] = {k: full_tensor(v).detach().clone() for k, v in resumed.model.state_dict().items()}
    out["resumed_avg"] = [full_tensor(s["exp_avg"]).clone() for s in resumed.optimizer.state.values()]
    actor = PPOActor(tiny_model(), cfg(), 1.0, 10, dp=dp, compute_dtype=torch.float32, ref_model=reference)
    out["metrics"] = actor.train_step(make_trajs())
    out["weights"] = {k: full_tensor(v).detach().clone() for k, v in actor.model.state_dict().items()}
    out["exp_avg"] = [full_tensor(s["exp_avg"]).clone() for s in actor.optimizer.state.values()]
    view = ShardedWeights(actor.model, torch.float32, bucket_bytes=8192)  # several buckets
    if rank == 0:
        pub = make_weight_channel("shm", role="publisher", run_id=f"dp{port}", bucket_mb=8192 / 2**20)
        sub = make_weight_channel("shm", role="receiver", run_id=f"dp{port}")
        got = sub.receive(pub.publish_begin(1, view))
        pub.publish_end()
        view.finish()
        out["published"] = {k: v.clone() for k, v in got.items()}
        out["n_buckets"], out["peak"] = len(view.layout.bucket_sizes), view.peak_bytes
        sub.close()
        pub.close()
    else:
        view.gather_all()
    save_shards(f"{out_dir}/two_ckpt", actor.model, actor.optimizer)
    if rank == 0:
        torch.save(out, f"{out_dir}/two.pt")


def _rank_main(target, rank, world, port, *args):
    """Run one rank, then leave the group together: a rank that exits while its peer still talks
    to it aborts in gloo's threads ('terminate called without an active exception', exit -6)."""
    import torch.distributed as dist

    target(rank, world, port, *args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _spawn(target, world, *args):
    ctx = mp.get_context("spawn")
    port = free_tcp_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes}"


def test_two_gloo_ranks_take_the_one_rank_step(tmp_path):
    """Equivalence, weights published from shards, and DCP checkpoints read back 1 -> 2 and 2 -> 1 ranks."""
    from areal_async.trainer.persist.sharded_ckpt import load_shards, save_shards

    base = tiny_model()
    w0 = {k: v.clone() for k, v in base.state_dict().items()}
    one = PPOActor(base, cfg(), 1.0, 10, ref_model=reference)
    m1 = one.train_step(make_trajs())
    w1 = base.state_dict()
    save_shards(tmp_path / "one_ckpt", base, one.optimizer)  # one process, no process group
    _spawn(_rank_step, 2, str(tmp_path))
    got = torch.load(tmp_path / "two.pt", weights_only=True)
    w2, m2 = got["weights"], got["metrics"]
    assert m1["rejected_frac"] > 0 and m1["skipped_steps"] == 0  # rejection is exercised
    for k in w1:
        rel = float((w2[k] - w1[k]).norm() / w1[k].norm())
        assert rel < 1e-5, f"{k}: 2-rank weights differ from 1-rank by {rel:.2e} (relative)"
        d1, d2 = w1[k] - w0[k], w2[k] - w0[k]
        if d1.norm() > 0:  # the update itself agrees, not only the weights (which barely move)
            assert float((d2 - d1).norm() / d1.norm()) < 1e-3, k
    for key in ("loss", "grad_norm", "rejected_frac", "clip_frac", "imp_weight_mean", "approx_kl", "n_loss_tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # published from shards: the bytes of the full weights, bucket by bucket, never the whole model at once
    assert list(got["published"]) == list(w2) and all(torch.equal(got["published"][k], w2[k]) for k in w2)
    total = sum(v.numel() * 4 for v in w2.values())
    assert got["n_buckets"] >= 4 and got["peak"] < total / 3
    # 1 -> 2 ranks: the 1-process checkpoint read into 2 ranks' shards
    assert all(torch.equal(got["resumed"][k], w1[k]) for k in w1)
    avg1 = [s["exp_avg"] for s in one.optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(got["resumed_avg"], avg1))
    # 2 -> 1 rank: the 2-rank shards read by one process without a process group
    fresh = PPOActor(tiny_model(seed=7), cfg(), 1.0, 10, ref_model=reference)
    load_shards(tmp_path / "two_ckpt", fresh.model, fresh.optimizer)
    assert all(torch.equal(fresh.model.state_dict()[k], w2[k]) for k in w2)
    assert all(torch.equal(s["exp_avg"], a) for s, a in zip(fresh.optimizer.state.values(), got["exp_avg"]))


def _mixed_precision_step(rank, world, port, out_path):
    from areal_async.trainer.compute.dp import full_tensor

    _init(rank, world, port)
    small = ActorConfig(optimizer=OptimizerConfig(lr=1e-6, gradient_clipping=0.0), mb_spec=MicroBatchSpec(64))
    actor = PPOActor(tiny_model(), small, 1.0, 10, compute_dtype=torch.bfloat16)
    seen = []
    layer = actor.model.model.layers[0].self_attn.q_proj
    layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    actor.train_step(make_trajs())
    state = {k: full_tensor(v).detach().clone() for k, v in actor.model.state_dict().items()}
    opt_dtypes = sorted({str(s["exp_avg"].dtype) for s in actor.optimizer.state.values()})
    torch.save({"weights": state, "compute": [str(d) for d in seen], "opt": opt_dtypes}, out_path)


def test_bf16_compute_moves_fp32_master_weights_where_a_bf16_optimizer_would_not(tmp_path):
    w0 = tiny_model().state_dict()
    _spawn(_mixed_precision_step, 1, str(tmp_path / "mp.pt"))  # FSDP2 on a group of one rank
    got = torch.load(tmp_path / "mp.pt", weights_only=True)
    assert set(got["compute"]) == {"torch.bfloat16"}  # forward ran on bf16 weights
    assert got["opt"] == ["torch.float32"]
    # the same step on a pure-bf16 model and optimizer
    pure = tiny_model().to(torch.bfloat16)
    w_bf16 = {k: v.clone() for k, v in pure.state_dict().items()}
    small = ActorConfig(optimizer=OptimizerConfig(lr=1e-6, gradient_clipping=0.0), mb_spec=MicroBatchSpec(64))
    PPOActor(pure, small, 1.0, 10).train_step(make_trajs())
    k = "model.layers.0.mlp.up_proj.weight"
    master, before = got["weights"][k], w0[k]
    assert master.dtype == torch.float32
    big = before.abs() > 1 / 128  # bf16 spacing there is >= 2**-14 = 6.1e-5, far above the ~1e-6 step
    moved = (master - before)[big].abs()
    assert float((moved > 0).float().mean()) > 0.9 and float(moved.max()) < 2e-6  # Adam's first step: about lr
    assert torch.equal(pure.state_dict()[k][big], w_bf16[k][big])  # bf16: every such update rounded away


LORA = LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj"))


def lora_cfg():
    return dataclasses.replace(cfg(), kl_ctl=0.0)  # the adapter's update alone (no reference model)


def _rank_lora_step(rank, world, port, out_path):
    """2 FSDP2 ranks, LoRA on the frozen base: one train_step, then the adapter alone published from the
    shards through a real shm weight channel (rank 0 receives it)."""
    from areal_async.trainer.compute.dp import DataParallel, full_tensor
    from areal_async.transport import make_weight_channel

    _init(rank, world, port)
    dp = DataParallel(rank, world)
    actor = PPOActor(lora.inject(tiny_model(), LORA, seed=0), lora_cfg(), 1.0, 10, dp=dp, compute_dtype=torch.float32)
    actor.train_step(make_trajs())
    out = {"weights": {k: full_tensor(v).detach().clone() for k, v in actor.model.state_dict().items()}}
    out["n_state"] = len(actor.optimizer.state)
    view = actor.publish_state(torch.float32, bucket_bytes=1024)
    if rank == 0:
        pub = make_weight_channel("shm", role="publisher", run_id=f"lora{port}", bucket_mb=1024 / 2**20)
        sub = make_weight_channel("shm", role="receiver", run_id=f"lora{port}")
        out["published"] = {k: v.clone() for k, v in sub.receive(pub.publish_begin(1, view)).items()}
        pub.publish_end()
        view.finish()
        out["n_buckets"] = len(view.layout.bucket_sizes)
        sub.close()
        pub.close()
        torch.save(out, out_path)
    else:
        view.gather_all()


def test_two_gloo_ranks_train_and_publish_the_lora_adapter_alone_as_one_rank_does(tmp_path):
    one = PPOActor(lora.inject(tiny_model(), LORA, seed=0), lora_cfg(), 1.0, 10)
    one.train_step(make_trajs())
    want = {k: v.detach() for k, v in lora.adapter_params(one.model).items()}
    _spawn(_rank_lora_step, 2, str(tmp_path / "lora.pt"))
    two = torch.load(tmp_path / "lora.pt", weights_only=True)
    assert two["published"].keys() == want.keys() and two["n_buckets"] > 1  # the adapter alone, several buckets
    for k, v in want.items():
        torch.testing.assert_close(two["published"][k], v, atol=1e-5, rtol=0)
    base = tiny_model().state_dict()
    for k, v in two["weights"].items():
        if ".lora_" not in k:  # the frozen base did not move on either rank
            assert torch.equal(v, base[k.replace(".base_layer.", ".")]), k
    assert two["n_state"] == len(want) and any(v.abs().sum() > 0 for k, v in want.items() if "lora_B" in k)
