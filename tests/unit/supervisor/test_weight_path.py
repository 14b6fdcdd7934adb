"""The weight path and the memory of each GPU (issue 36, item 5; ``supervisor/weight_path.py``).

Expected values by hand: DeepSeek-R1-Distill-Qwen-1.5B (the boba preset's model; its public config.json:
hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocabulary 151936, untied) has 1,777,088,000 parameters
(Qwen2-1.5B's 1,543,714,304 plus a separate 151936 x 1536 output layer); the shape formula leaves out the q/k/v
biases, 28 x (1536 + 256 + 256) = 57,344 of them. A version in bfloat16 is 2 bytes a parameter. SGLang 0.5.23
keeps at least 10 GiB of an 80 GiB GPU for itself (arg_groups/memory_hook.py line 315), outside
mem_fraction_static; vLLM keeps nothing outside gpu_memory_utilization.
"""

from __future__ import annotations

import json

import pytest

from areal_async.config import load_config
from areal_async.supervisor.placement import place, shape_of
from areal_async.supervisor.preflight import Context, check_gpu_memory, check_placement, report
from areal_async.supervisor import weight_path as W

R1_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
R1_PARAMS = 1_777_088_000
GiB = 1 << 30


@pytest.fixture()
def r1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(R1_CONFIG))
    return str(tmp_path)


def boba(r1: str, *over: str):
    return load_config("configs/boba_grpo.yaml", [f"model.path={r1}", *over])


def test_the_shapes_give_the_models_parameter_count(r1):
    assert W.param_count(boba(r1), 100) == R1_PARAMS - 28 * (1536 + 256 + 256)


def test_the_shipped_preset_keeps_the_weights_off_the_server_gpus(r1):
    cfg = boba(r1)
    placement = place(shape_of(cfg, {}))
    hops = W.weight_hops(cfg, placement, W.version_bytes(cfg, R1_PARAMS))
    assert [(h.src, h.dst, h.nbytes) for h in hops] == [
        ("trainer (node 0 GPU 4)", "/dev/shm", 2 * R1_PARAMS),
        ("/dev/shm", "rollout-0 (host)", 0),
        ("rollout-0 (host)", "sglang-0 (node 0 GPU 0)", 2 * R1_PARAMS),
    ]
    assert "gloo broadcast" in hops[2].how and "device-to-host" not in hops[2].how
    held = W.gpu_holdings(cfg, placement, 2 * R1_PARAMS, R1_PARAMS)
    assert [(h.who, h.nbytes) for h in held[(0, 0)]] == [("sglang-0", 0), ("rollout-0", 0)]
    assert W.server_gpu_overflow(cfg, placement, 2 * R1_PARAMS, R1_PARAMS, 80 * GiB) is None


@pytest.mark.parametrize(
    "fraction,refused",
    [(0.9, True), (0.8, True), (0.7, False)],  # rest 8 / 16 / 24 GiB, SGLang's 10 out: room 0 / 6 / 14 GiB
)
def test_weights_over_nccl_beside_sglang_need_room_the_fraction_leaves(r1, fraction, refused):
    """Over NCCL the worker keeps two versions on its server's GPU (2 x 3.31 GiB) and a CUDA context (0.5)."""
    cfg = boba(
        r1, "tensor_channel.weights=nccl", "tensor_channel.trajectories=nccl", f"sglang.mem_fraction_static={fraction}"
    )
    placement = place(shape_of(cfg, {}))
    over = W.server_gpu_overflow(cfg, placement, 2 * R1_PARAMS, R1_PARAMS, 80 * GiB)
    assert (over is not None) == refused
    if refused:
        key, value, what = over
        assert (key, value) == ("tensor_channel.weights", "nccl")
        assert "rollout-0 on node 0 GPU 0 beside sglang-0 would allocate 7.12 GiB" in what
        assert f"sglang.mem_fraction_static={fraction:g} leaves {(1 - fraction) * 80:.2f} GiB of a 80.0 GiB GPU" in what


@pytest.mark.parametrize("util,refused", [(0.9, False), (0.92, True)])  # room 8.0 / 6.4 GiB for 7.12
def test_beside_vllm_the_room_is_what_gpu_memory_utilization_leaves(r1, util, refused):
    cfg = boba(r1, "rollout.backend=vllm:d4", "tensor_channel.weights=nccl", f"vllm.gpu_memory_utilization={util}")
    placement = place(shape_of(cfg, {}))
    assert (W.server_gpu_overflow(cfg, placement, 2 * R1_PARAMS, R1_PARAMS, 80 * GiB) is not None) == refused


def test_the_preflight_refuses_on_a_known_gpu_and_the_dry_run_prints_path_and_memory(r1):
    cfg = boba(r1, "tensor_channel.weights=nccl", "cluster.gpu_memory_gib=80")
    ctx = Context(cfg, gpus_here=8)
    check_placement(ctx)
    [f] = check_gpu_memory(ctx)
    assert f.level == "error" and "room for 0.0 MiB" in f.line and "use tensor_channel.weights=shm" in f.line
    text = report(Context(boba(r1, "cluster.gpu_memory_gib=80"), gpus_here=8, placement=ctx.placement), [], "run")
    assert "# weight path per update (1777.0M parameters, bfloat16: 3.31 GiB a version" in text
    assert "#   node 0 GPU 0: sglang-0 0.9 x GPU = 72.00 GiB" in text and "rollout-0 0 B" in text
    assert "#   node 0 GPU 4: trainer 7.18 GiB" in text  # 16 B x 1.777e9 / 4 = 6.62 GiB + 0.5 context + 64 MiB
