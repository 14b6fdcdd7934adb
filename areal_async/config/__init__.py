"""Experiment configuration: nested dataclasses, YAML presets, dotted ``key=value`` overrides.

Every field carries its help text as ``field(metadata={"help": ...})`` (``areal-async knobs``
lists them). Every section validates itself when built (``__post_init__``: field types, then
its own ranges and choices), and ``ExperimentConfig`` adds the rules that join sections, so a
bad preset or override fails before any process starts, with a message naming the dotted key,
the value and what was expected. After assigning fields by hand, ``cfg.validate()`` checks the
whole tree again.

Modules: ``base`` (ConfigError, field helpers, checks, the ``Section`` base), ``sections`` (policy,
data, sampling, rollout, PPO, reward), ``cluster`` (the fleet, CPU pinning, Slurm, tensor channels),
``objective`` (the actor's objective keys), ``experiment`` (the run-level sections and
``ExperimentConfig``), ``loading`` (YAML, overrides, coercion, ``describe``).

Why dataclasses and not pydantic: the sections are plain stdlib dataclasses that the trainer,
rollout and data code already take as arguments and build directly in tests; validation
here is a few lines per section in one error format (``key=value: expected ...``), and YAML
coercion is deliberately strict (``gconfig.greedy=3`` is refused, not read as true). Pydantic
would add a dependency, its own error format and lax coercion rules that would have to be
turned off field by field, for no check we cannot write as plainly.

Names follow the AReaL v0.2 "boba" seed where it has one (``max_head_offpolicyness``,
``eps_clip``, ``reward_scaling``, ``mb_spec.max_tokens_per_mb`` ...), so a boba config can be
expressed here key for key (see ``configs/boba_grpo.yaml``). Fields that are accepted and
checked but read by no code yet say so in their help (``[not read yet: wired by ...]``).
"""

from areal_async.config.base import ConfigError, CpuList, Section
from areal_async.config.experiment import (
    EvaluatorConfig,
    ExperimentConfig,
    RecoverConfig,
    RefConfig,
    SaverConfig,
    SFTConfig,
    SFTWarmupConfig,
    SGLangConfig,
    StatsLoggerConfig,
    VLLMConfig,
    n_servers,
    server_addresses,
)
from areal_async.config.loading import describe, from_dict, load_config, parse_override, to_dict, to_yaml
from areal_async.config.cluster import ClusterConfig, CpuAffinityConfig, SlurmConfig, TensorChannelConfig
from areal_async.config.objective import NORM_LEVELS, NormConfig, RejectionSamplingConfig
from areal_async.config.sections import (
    DTYPES,
    LR_SCHEDULES,
    ActorConfig,
    DatasetConfig,
    GenerationConfig,
    LoraConfig,
    MicroBatchSpec,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    rollout_dp_degree,
)

__all__ = [
    "DTYPES",
    "LR_SCHEDULES",
    "NORM_LEVELS",
    "ActorConfig",
    "ClusterConfig",
    "ConfigError",
    "CpuAffinityConfig",
    "SlurmConfig",
    "CpuList",
    "DatasetConfig",
    "EvaluatorConfig",
    "ExperimentConfig",
    "GenerationConfig",
    "LoraConfig",
    "MicroBatchSpec",
    "ModelConfig",
    "NormConfig",
    "OptimizerConfig",
    "RecoverConfig",
    "RefConfig",
    "RejectionSamplingConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTWarmupConfig",
    "SGLangConfig",
    "SaverConfig",
    "Section",
    "StatsLoggerConfig",
    "TensorChannelConfig",
    "VLLMConfig",
    "describe",
    "from_dict",
    "load_config",
    "n_servers",
    "parse_override",
    "rollout_dp_degree",
    "server_addresses",
    "to_dict",
    "to_yaml",
]
