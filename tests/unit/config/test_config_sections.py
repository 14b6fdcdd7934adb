"""Each config section refuses its own bad values when built directly (no loader involved), naming
the field; the loader puts the dotted path in front; cross-section rules live on ExperimentConfig;
the tensor-channel kinds config accepts are exactly the ones the transport factory builds."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

from areal_async.config.gym_tasks import CurriculumConfig
from areal_async.config.experiment import SoloConfig
from areal_async.config.objective import ObjectiveConfig
from areal_async.config import (
    ActorConfig,
    ClusterConfig,
    ConfigError,
    CpuAffinityConfig,
    DatasetConfig,
    EvaluatorConfig,
    ExperimentConfig,
    GenerationConfig,
    LoraConfig,
    MicroBatchSpec,
    ModelConfig,
    NormConfig,
    OptimizerConfig,
    RecoverConfig,
    RefConfig,
    RejectionSamplingConfig,
    RewardConfig,
    RolloutConfig,
    SaverConfig,
    Section,
    SFTConfig,
    SFTWarmupConfig,
    SGLangConfig,
    SlurmConfig,
    StatsLoggerConfig,
    TensorChannelConfig,
    VLLMConfig,
    describe,
    from_dict,
)

# (section, bad fields, the message's start "key=value", a fragment of what was expected): hand-picked
BAD = [
    (ModelConfig, {"arch": "gpt2"}, "arch='gpt2'", "llama | qwen2"),
    (ModelConfig, {"dtype": "fp8"}, "dtype='fp8'", "float32 | bfloat16 | float16"),
    (ModelConfig, {"hidden_size": 65}, "hidden_size=65", "a multiple of num_attention_heads=4"),
    (ModelConfig, {"num_key_value_heads": 3}, "num_key_value_heads=3", "a divisor of num_attention_heads=4"),
    (ModelConfig, {"num_attention_heads": 0}, "num_attention_heads=0", "an integer >= 1"),
    (ModelConfig, {"hidden_size": "64"}, "hidden_size='64'", "an integer"),
    (DatasetConfig, {"type": "jsonl"}, "path=None", "a jsonl path"),
    (DatasetConfig, {"ops": "+/"}, "ops='+/'", "'+-*'"),
    (DatasetConfig, {"batch_size": 0}, "batch_size=0", ">= 1"),
    (DatasetConfig, {"type": "reasoning_gym"}, "tasks=[]", "a non-empty list"),
    (DatasetConfig, {"type": "reasoning_gym", "tasks": [{"name": "x", "weight": -2}]}, "tasks[0].weight=-2", "> 0"),
    (CurriculumConfig, {"threshold": 0.0}, "threshold=0.0", "a number in (0, 1]"),
    (CurriculumConfig, {"window": 0}, "window=0", ">= 1"),
    (GenerationConfig, {"temperature": 0.0}, "temperature=0.0", "> 0 (or greedy=true)"),
    (GenerationConfig, {"top_p": 1.5}, "top_p=1.5", "(0, 1]"),
    (GenerationConfig, {"greedy": 1}, "greedy=1", "true or false"),
    (GenerationConfig, {"stop_token_ids": 2}, "stop_token_ids=2", "a list"),
    (RolloutConfig, {"backend": "sglang:d0"}, "backend='sglang:d0'", "'sglang:dN' with N >= 1"),
    (RolloutConfig, {"backend": "tgi"}, "backend='tgi'", "'vllm:dN'"),
    (RolloutConfig, {"backend": "sglang", "token_entropy": True}, "token_entropy=True", "false unless backend=torch"),
    (RolloutConfig, {"workflow": "m:W", "token_entropy": True}, "token_entropy=True", "no workflow"),
    (VLLMConfig, {"probe_atol": 0}, "probe_atol=0", "> 0"),
    (VLLMConfig, {"addresses": ["localhost:8000"]}, "addresses='localhost:8000'", "http://host:port"),
    (VLLMConfig, {"keep_versions": 0}, "keep_versions=0", ">= 1"),
    (RolloutConfig, {"max_head_offpolicyness": -1}, "max_head_offpolicyness=-1", ">= 0"),
    (RejectionSamplingConfig, {"upper": 1.0}, "upper=1.0", "> 1"),
    (RejectionSamplingConfig, {"mode": "drop"}, "mode='drop'", "mask | clamp"),
    (NormConfig, {"mean_level": "token"}, "mean_level='token'", "group | batch | none"),
    (OptimizerConfig, {"lr": -0.001}, "lr=-0.001", "> 0"),
    (OptimizerConfig, {"beta2": 1.0}, "beta2=1.0", "[0, 1)"),
    (OptimizerConfig, {"lr_scheduler_type": "step"}, "lr_scheduler_type='step'", "constant | linear | cosine"),
    (OptimizerConfig, {"lr": "fast"}, "lr='fast'", "a number"),
    (MicroBatchSpec, {"max_tokens_per_mb": 0}, "max_tokens_per_mb=0", ">= 1"),
    (MicroBatchSpec, {"oversize": "split"}, "oversize='split'", "error | own_mb"),
    (ActorConfig, {"eps_clip": 0.0}, "eps_clip=0.0", "> 0"),
    (LoraConfig, {"rank": -4}, "rank=-4", "an integer >= 0"),
    (ActorConfig, {"discount": 1.5}, "discount=1.5", "[0, 1]"),
    (ObjectiveConfig, {"c_clip": 0.5}, "c_clip=0.5", "> 1 or None"),  # see unit/trainer/test_objectives.py
    (ActorConfig, {"mb_spec": {"max_tokens_per_mb": 8}}, "mb_spec={", "a MicroBatchSpec"),
    (RewardConfig, {"fn": "no_colon"}, "fn='no_colon'", "'module:function'"),
    (RewardConfig, {"memory_limit_mb": 100}, "memory_limit_mb=100", "0 (no limit) or >= 256"),
    (CpuAffinityConfig, {"trainer": "0-x"}, "trainer='0-x'", "a cpu list"),
    (CpuAffinityConfig, {"rollout": "3-1"}, "rollout='3-1'", "a cpu list"),  # runs backwards
    (CpuAffinityConfig, {"reward": [0]}, "reward=[0]", "a cpu list"),
    (ClusterConfig, {"worker_timeout_s": 1.0}, "worker_timeout_s=1.0", "> heartbeat_s=2.0"),
    (ClusterConfig, {"launcher": "k8s"}, "launcher='k8s'", "local | ray | slurm"),
    (ClusterConfig, {"retained_heap_mb": -1}, "retained_heap_mb=-1", ">= 0"),
    (ClusterConfig, {"malloc_arenas": -1}, "malloc_arenas=-1", ">= 0"),
    (ClusterConfig, {"node_hosts": ["a", "b"], "control": "tcp"}, "node_hosts=['a', 'b']", "(cluster.n_nodes=1)"),
    (ClusterConfig, {"n_nodes": 2, "node_hosts": ["a", "b:9"]}, "node_hosts=['a', 'b:9']", "no port"),
    (ClusterConfig, {"n_nodes": 2, "node_hosts": ["a", "b"]}, "node_hosts=['a', 'b']", "cluster.control=tcp"),
    (SlurmConfig, {"sbatch_args": ["qos=high"]}, "sbatch_args=['qos=high']", "each starting with '-'"),
    (SlurmConfig, {"cpus_per_node": -1}, "cpus_per_node=-1", ">= 0"),
    (ClusterConfig, {"n_gpus_per_node": 0}, "n_gpus_per_node=0", ">= 1"),
    (TensorChannelConfig, {"weights": "rdma"}, "weights='rdma'", "shm | zmq | gloo | nccl | cuda_ipc"),
    (TensorChannelConfig, {"bucket_mb": 0.0}, "bucket_mb=0.0", "> 0"),
    (TensorChannelConfig, {"weights": "gloo", "weight_delta": True}, "weight_delta=True", "weights shm or zmq"),
    (SFTWarmupConfig, {"steps": -1}, "steps=-1", ">= 0"),
    (RefConfig, {"dtype": "int8"}, "dtype='int8'", "float32 | bfloat16 | float16"),
    (SGLangConfig, {"mem_fraction_static": 0.0}, "mem_fraction_static=0.0", "(0, 1]"),
    (SGLangConfig, {"max_running_requests": 0}, "max_running_requests=0", "null or an integer >= 1"),
    (VLLMConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5", "(0, 1]"),
    (EvaluatorConfig, {"n_samples": 4}, "n_samples=4", "1 when greedy=true"),
    (SFTConfig, {"epochs": 0.0}, "epochs=0.0", "> 0"),
    (SaverConfig, {"keep_last": 0}, "keep_last=0", ">= 1"),
    (RecoverConfig, {"mode": "always"}, "mode='always'", "disabled | auto | resume"),
    (StatsLoggerConfig, {"progress": "yes"}, "progress='yes'", "true or false"),
    (SoloConfig, {"recording": "runs/a", "weights": "runs/b"}, "weights='runs/b'", "'' when recording is set"),
    (ExperimentConfig, {"total_train_steps": 0}, "total_train_steps=0", ">= 1"),
]


@pytest.mark.parametrize("cls,fields,start,expected", BAD, ids=[f"{b[0].__name__}-{b[2]}" for b in BAD])
def test_a_section_refuses_its_own_bad_value(cls, fields, start, expected):
    assert cls()  # the defaults are valid
    with pytest.raises(ConfigError) as e:
        cls(**fields)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


@dataclass
class _Optionals(Section):
    old_style: Optional[int] = None
    new_style: int | None = None  # the spelling a pyupgrade rule would turn the first one into


@pytest.mark.parametrize("name", ["old_style", "new_style"])
def test_optional_fields_take_none_or_their_type_in_either_spelling(name):
    assert getattr(_Optionals(**{name: 3}), name) == 3 and getattr(_Optionals(), name) is None
    with pytest.raises(ConfigError, match=f"^{name}='3': expected an integer"):
        _Optionals(**{name: "3"})


def _sections(cls: type = Section) -> set[str]:
    """Every class deriving from ``cls``, at any depth (ActorConfig derives from ObjectiveConfig)."""
    out: set[str] = set()
    for sub in cls.__subclasses__():
        out |= {sub.__name__} | _sections(sub)
    return out


def test_every_section_has_a_refusal_above():
    assert _sections() - {"_Optionals"} == {b[0].__name__ for b in BAD}


CROSS = [  # rules that join sections live on ExperimentConfig and name the full dotted key
    ({"actor": ActorConfig(ppo_n_minibatches=200)}, "actor.ppo_n_minibatches=200", "<= samples per step (128)"),
    (
        {"rollout": RolloutConfig(backend="sglang:d3")},
        "rollout.backend='sglang:d3'",
        "a multiple of cluster.n_rollout_workers=2",
    ),  # on cpu: the CPU servers, each worker owning its own
    (
        {"rollout": RolloutConfig(backend="sglang:d16"), "cluster": ClusterConfig(device="cuda")},
        "rollout.backend='sglang:d16'",
        "cluster.n_nodes * cluster.n_gpus_per_node = 8",
    ),
    (
        {
            "rollout": RolloutConfig(backend="sglang"),
            "cluster": ClusterConfig(device="cuda"),
            "sglang": SGLangConfig(context_length=1000),
        },
        "sglang.context_length=1000",
        "= 1040",
    ),  # 1024 + 16
    (
        {"cluster": ClusterConfig(control="tcp", n_nodes=2, node_hosts=["127.0.0.1", "127.0.0.2"])},
        "cluster.node_hosts=['127.0.0.1', '127.0.0.2']",
        "tensor channel(s) shm reach one host only",
    ),  # the default weight channel is shm
    *[
        (
            {
                "rollout": RolloutConfig(backend="sglang"),
                "actor": ActorConfig(lora=LoraConfig(rank=4)),
                "sglang": SGLangConfig(pause_mode=mode),
            },
            f"sglang.pause_mode='{mode}'",
            "SGLang binds a request to the adapter it started with",
        )  # issue 36 item 6: the previous adapter's unload would wait for the paused requests forever
        for mode in ("retract", "in_place")
    ],
]


@pytest.mark.parametrize("sections,start,expected", CROSS, ids=[c[1] for c in CROSS])
def test_experiment_config_checks_the_rules_between_sections(sections, start, expected):
    with pytest.raises(ConfigError) as e:
        ExperimentConfig(**sections)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "override",
    [
        "actor.mb_spec.max_tokens_per_mb=0",
        "ref.mb_spec.max_tokens_per_mb=0",
        "actor.optimizer.beta2=1",
        "sft.optimizer.beta2=1",
        "actor.adv_norm.mean_level=token",
        "cluster.cpu_affinity.trainer=0-x",
    ],
)
def test_the_loader_names_the_dotted_key_of_a_shared_section(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        from_dict({}, [override])
    assert str(e.value).startswith(f"{key}=") and value in str(e.value), str(e.value)


def test_partial_sections_keep_the_parents_defaults_and_types_are_coerced():
    c = from_dict(
        {"actor": {"adv_norm": {"std_level": "group"}, "optimizer": {"lr": "1e-3"}}},
        ["cluster.cpu_affinity.trainer=1", "actor.eps_clip=1"],
    )
    assert (c.actor.adv_norm.mean_level, c.actor.adv_norm.std_level) == ("batch", "group")
    assert c.actor.optimizer.lr == 0.001 and c.actor.eps_clip == 1.0 and isinstance(c.actor.eps_clip, float)
    assert c.cluster.cpu_affinity.trainer == "1"


def test_validate_checks_fields_assigned_after_building():
    c = from_dict({})
    c.actor.optimizer.lr = -1.0
    with pytest.raises(ConfigError, match=r"^actor\.optimizer\.lr=-1\.0: expected > 0"):
        c.validate()
    c.actor.optimizer.lr = 1e-4
    c.gconfig.n_samples, c.actor.ppo_n_minibatches = 1, 17  # > 16 prompts x 1 sample
    with pytest.raises(ConfigError, match=r"^actor\.ppo_n_minibatches=17: expected <= samples per step \(16\)"):
        c.validate()


def test_unread_fields_say_so_in_their_help():
    unread = {k for k, text in describe() if "[not read yet: wired by" in text}
    assert unread == {"ref.mb_spec.max_tokens_per_mb", "ref.mb_spec.oversize"}


def test_channel_kinds_are_the_ones_the_factory_builds():
    from areal_async.transport import factory, make_tensor_channel, make_weight_channel

    five = {"shm", "zmq", "gloo", "nccl", "cuda_ipc"}  # the README's list
    assert set(factory._TENSOR) == set(factory._WEIGHT) == five
    for kind in sorted(five):
        assert TensorChannelConfig(weights=kind, trajectories=kind).weights == kind
    with pytest.raises(ConfigError, match="trajectories='rdma'"):
        TensorChannelConfig(trajectories="rdma")
    for make in (make_tensor_channel, make_weight_channel):
        with pytest.raises(ValueError, match=r"'rdma': expected one of shm \| zmq \| gloo \| nccl \| cuda_ipc"):
            make("rdma", role="receiver")


def _imported_after(module: str, names: set[str]) -> str:
    code = f"import sys, {module}; print(sorted({names!r} & set(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()


def test_config_imports_no_transport_or_torch_and_transport_no_config():
    assert _imported_after("areal_async.config", {"torch", "areal_async.transport"}) == "[]"  # dry runs stay fast
    assert _imported_after("areal_async.transport.factory", {"areal_async.config"}) == "[]"


ON_WEIGHTS_REFUSED = [  # issue 42: rollout.on_weights through the servers' pause modes
    (["rollout.backend=sglang", "rollout.on_weights=keep"], "rollout.on_weights='keep'", "sglang.pause_mode=in_place"),
    (
        ["rollout.backend=sglang", "sglang.pause_mode=in_place"],
        "sglang.pause_mode='in_place'",
        "rollout.on_weights=keep",
    ),
    (["rollout.backend=vllm", "rollout.on_weights=keep"], "rollout.on_weights='keep'", "no per-token weight version"),
    (["rollout.on_weights=drain"], "rollout.on_weights='drain'", "recompute | keep | finish"),
    (["rollout.over_provision=-0.5"], "rollout.over_provision=-0.5", "in [0, 4]"),
]


@pytest.mark.parametrize("overrides,start,expected", ON_WEIGHTS_REFUSED, ids=[r[1] for r in ON_WEIGHTS_REFUSED])
def test_on_weights_and_pause_modes_must_agree(overrides, start, expected):
    from areal_async.config import from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({}, overrides)
    assert str(e.value).startswith(start) and expected in str(e.value), str(e.value)


def test_on_weights_accepted_combinations():
    from areal_async.config import from_dict

    for o in (
        ["rollout.backend=sglang", "rollout.on_weights=keep", "sglang.pause_mode=in_place"],
        ["rollout.backend=sglang", "rollout.on_weights=finish", "sglang.pause_mode=retract"],
        ["rollout.backend=vllm", "rollout.on_weights=finish"],
        ["rollout.on_weights=keep", "rollout.over_provision=0.25"],
    ):
        from_dict({}, o)
