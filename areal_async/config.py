"""Experiment configuration: nested dataclasses, YAML presets, dotted ``key=value`` overrides.

Every field carries a ``help`` string (``field(metadata={"help": ...})``); ``ExperimentConfig``
is validated as a whole when built (ranges and cross-field rules), so a bad preset or override
fails before any process starts, with a message naming the key and what was expected.

Names follow the AReaL v0.2 "boba" seed where it has one (``max_head_offpolicyness``,
``eps_clip``, ``reward_scaling``, ``mb_spec.max_tokens_per_mb`` ...), so a boba config can be
expressed here key for key (see ``configs/boba_grpo.yaml``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A config key is unknown or its value is out of range; the message names both."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = (lambda d=default: type(d)(**dataclasses.asdict(d))) if dataclasses.is_dataclass(default) \
            else (lambda d=default: type(d)(d))
        return field(default_factory=factory, metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _sub(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """The policy model: a local HF directory, or a tiny Llama/Qwen2 built from these numbers."""

    path: Optional[str] = _f(None, "Local HF model directory; None builds a tiny model from the fields below (no download).")
    arch: str = _f("llama", "Architecture of the built model: 'llama' or 'qwen2'.")
    hidden_size: int = _f(64, "Hidden size of the built model.")
    intermediate_size: int = _f(128, "MLP width of the built model.")
    num_hidden_layers: int = _f(2, "Transformer layers of the built model.")
    num_attention_heads: int = _f(4, "Attention heads of the built model.")
    num_key_value_heads: int = _f(4, "KV heads of the built model (GQA when smaller than heads).")
    max_position_embeddings: int = _f(256, "Context length of the built model.")
    dtype: str = _f("float32", "Parameter dtype: float32 | bfloat16 | float16.")
    tie_word_embeddings: bool = _f(False, "Tie input and output embeddings of the built model.")


@dataclass
class DatasetConfig:
    """Where prompts come from. ``type: tiny_arith`` generates an arithmetic task locally."""

    type: str = _f("tiny_arith", "'tiny_arith' (generated locally) or 'jsonl' (lines with 'prompt' and 'solutions').")
    path: Optional[str] = _f(None, "jsonl file for type 'jsonl'.")
    batch_size: int = _f(16, "Prompts per trainer step (each expands to gconfig.n_samples samples).")
    max_prompt_len: int = _f(1024, "Prompts longer than this many tokens are filtered out.")
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded).")
    size: int = _f(2000, "tiny_arith: number of generated problems.")
    max_operand: int = _f(9, "tiny_arith: operands are drawn from 0..max_operand.")
    ops: str = _f("+", "tiny_arith: operators to draw from, e.g. '+-'.")


@dataclass
class GenerationConfig:
    """Sampling parameters of the rollout engines (the seed's ``gconfig``)."""

    n_samples: int = _f(8, "Samples per prompt (a GRPO group).")
    max_new_tokens: int = _f(16, "Maximum generated tokens per sample.")
    temperature: float = _f(1.0, "Sampling temperature (> 0 unless greedy).")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1].")
    greedy: bool = _f(False, "Greedy decoding (ignores temperature and top_p).")
    stop_token_ids: list = _f([], "Extra token ids that end a sample (eos always does).")


@dataclass
class RolloutConfig:
    """Rollout workers and the asynchrony budget."""

    backend: str = _f("torch", "Engine: 'torch' (embedded, CPU or GPU) or 'sglang[:dN]' (server, GPU).")
    max_head_offpolicyness: int = _f(2, "η: trainer step v consumes only samples whose oldest token version >= v - η; 0 = synchronous on-policy.")
    max_concurrent_rollouts: int = _f(64, "Upper bound on prompt groups generating at once across all rollout workers.")
    dump_to_file: bool = _f(False, "Write RUN_DIR/trajectories.jsonl (one line per trained or aborted sample).")
    max_batch_groups: int = _f(16, "Groups one rollout worker decodes together in one batch.")


@dataclass
class RejectionSamplingConfig:
    """Behaviour-importance rejection of the decoupled loss."""

    metric: str = _f("ratio", "'ratio' (exp(prox_logp - behav_logp)) or 'none'.")
    upper: float = _f(5.0, "Tokens whose importance weight exceeds this are rejected.")
    mode: str = _f("mask", "'mask' drops rejected tokens from the loss; 'clamp' clips their weight to 'upper'.")


@dataclass
class NormConfig:
    """Mean/std normalization levels ('group', 'batch' or 'none')."""

    mean_level: str = _f("group", "Subtract the mean over: group | batch | none.")
    std_level: str = _f("group", "Divide by the std over: group | batch | none.")
    eps: float = _f(1e-5, "Added to the std.")


@dataclass
class OptimizerConfig:
    """AdamW with a learning-rate schedule."""

    lr: float = _f(1e-3, "Peak learning rate.")
    eps: float = _f(1e-8, "Adam epsilon.")
    beta1: float = _f(0.9, "Adam beta1.")
    beta2: float = _f(0.999, "Adam beta2.")
    weight_decay: float = _f(0.0, "Decoupled weight decay.")
    lr_scheduler_type: str = _f("constant", "constant | linear | cosine.")
    warmup_steps_proportion: float = _f(0.0, "Fraction of total steps spent in linear warm-up.")
    min_lr_ratio: float = _f(0.0, "Final lr / peak lr for linear and cosine schedules.")
    gradient_clipping: float = _f(1.0, "Max global grad norm (0 disables).")


@dataclass
class MicroBatchSpec:
    """How a batch is split into packed micro-batches."""

    max_tokens_per_mb: int = _f(16384, "Token budget of one packed micro-batch.")
    oversize: str = _f("error", "A sequence longer than the budget: 'error' or 'own_mb' (gets a micro-batch of its own).")


@dataclass
class ActorConfig:
    """The trained policy and its PPO objective (GRPO-style: no critic)."""

    mb_spec: MicroBatchSpec = _sub(MicroBatchSpec, "Micro-batch packing.")
    optimizer: OptimizerConfig = _sub(OptimizerConfig, "Optimizer and schedule.")
    kl_ctl: float = _f(0.0, "KL penalty to the reference model; 0 loads no reference model.")
    eps_clip: float = _f(0.2, "PPO ratio clip.")
    reward_scaling: float = _f(1.0, "Reward fed to the loss = (score + reward_bias) * reward_scaling.")
    reward_bias: float = _f(0.0, "See reward_scaling (boba: bias -0.5, scaling 10 -> -5/+5).")
    reward_norm: NormConfig = _sub(NormConfig, "Reward normalization (boba: group level).")
    adv_norm: NormConfig = _f(NormConfig(mean_level="batch", std_level="batch"), "Advantage normalization (boba: batch level).")
    discount: float = _f(1.0, "GAE gamma.")
    gae_lambda: float = _f(1.0, "GAE lambda.")
    ppo_n_minibatches: int = _f(1, "PPO minibatches (optimizer steps) per trainer step.")
    use_decoupled_loss: bool = _f(False, "Decoupled PPO: behaviour, proximal and current policies.")
    recompute_logprob: bool = _f(False, "Recompute proximal logprobs with the trainer's weights before the update.")
    rejection_sampling: RejectionSamplingConfig = _sub(RejectionSamplingConfig, "Importance-weight rejection (decoupled loss).")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")


@dataclass
class RewardConfig:
    """Reward workers: a pool of killable processes running the reward function."""

    fn: str = _f("areal_async.reward.math_verify_reward:boxed_math_reward", "Dotted path 'module:function' of the reward function.")
    timeout_s: float = _f(5.0, "A check past this is killed and scores 0 with status 'timeout'.")
    n_procs: int = _f(1, "Processes per reward worker.")
    precision: int = _f(6, "Significant digits for numeric comparison (math-verify float_rounding).")
    memory_limit_mb: int = _f(4096, "Address-space cap of each checking process (a check past it scores 0, status 'error'); 0 = none.")


class CpuList(str):
    """A Linux cpu list ('0', '1-3', '0,2'); YAML and overrides may also give one CPU as a number."""


@dataclass
class CpuAffinityConfig:
    """CPUs each role's processes are pinned to (Linux cpu-list syntax: '0', '1-3', '0,2'); '' = not pinned.

    Opt-in. On a machine with few cores it gives the trainer a core of its own, as it has its own
    devices on a GPU cluster: in an async pipeline the trainer is the bottleneck whenever
    t_train >= t_gen, and every time slice it loses to decoding or reward checks is lost
    throughput. Checked against the CPUs this machine allows before anything starts."""

    scheduler: CpuList = _f("", "CPUs of the scheduler process.")
    trainer: CpuList = _f("", "CPUs of the trainer process.")
    rollout: CpuList = _f("", "CPUs of every rollout worker.")
    reward: CpuList = _f("", "CPUs of every reward worker and its checking processes.")


@dataclass
class ClusterConfig:
    """Fleet shape and the control plane."""

    n_rollout_workers: int = _f(2, "Rollout worker processes.")
    n_reward_workers: int = _f(1, "Reward worker processes.")
    launcher: str = _f("local", "local | ray | slurm.")
    control: str = _f("ipc", "ZeroMQ endpoints: 'ipc' (one host) or 'tcp'.")
    host: str = _f("127.0.0.1", "Address the scheduler and trainer bind for 'tcp'.")
    heartbeat_s: float = _f(2.0, "Heartbeat period of every worker.")
    worker_timeout_s: float = _f(120.0, "A worker silent this long is declared dead.")
    max_restarts: int = _f(2, "Times the supervisor restarts each dead rollout or reward worker before failing the run "
                              "(zmq/shm channels only); the trainer and scheduler are never restarted: rerun with "
                              "recover.mode=auto.")
    torch_threads: int = _f(1, "torch intra-op threads per worker process.")
    cpu_affinity: CpuAffinityConfig = _f(CpuAffinityConfig(), "Pin each role's processes to CPUs (local launcher).")
    device: str = _f("cpu", "cpu | cuda.")
    n_nodes: int = _f(1, "Machines in the fleet (the seed: one node).")
    n_gpus_per_node: int = _f(8, "GPUs per machine (the seed: 8); bounds the rollout backend's data-parallel degree dN.")


@dataclass
class TensorChannelConfig:
    """How tensors move (trajectories rollout -> trainer, weights trainer -> rollout)."""

    weights: str = _f("shm", "Weight channel: shm | zmq | gloo | nccl | cuda_ipc.")
    trajectories: str = _f("zmq", "Trajectory channel: zmq | shm | gloo | nccl | cuda_ipc.")
    bucket_mb: float = _f(64.0, "Weight-sync bucket size in MiB.")


@dataclass
class SFTWarmupConfig:
    """Optional supervised warm-up of the initial weights (version 0) before RL."""

    steps: int = _f(0, "SFT steps on the training prompts' reference answers; 0 disables.")
    batch_size: int = _f(64, "Sequences per SFT step.")
    lr: float = _f(3e-3, "SFT learning rate.")


@dataclass
class RefConfig:
    """The frozen reference policy of the KL penalty (the seed's ``ref``); loaded only when actor.kl_ctl > 0."""

    path: Optional[str] = _f(None, "Local HF directory of the reference model; None = the initial policy (model.path or the built tiny model).")
    dtype: str = _f("float32", "Reference model dtype: float32 | bfloat16 | float16.")
    mb_spec: MicroBatchSpec = _sub(MicroBatchSpec, "Micro-batch packing of the reference forward passes.")


@dataclass
class SGLangConfig:
    """SGLang server settings for ``rollout.backend: sglang[:dN]`` (seed's ``sglang``; model, seed and dtype follow model.* and seed)."""

    context_length: int = _f(32768, "Server context limit in tokens; must hold train_dataset.max_prompt_len + gconfig.max_new_tokens.")
    mem_fraction_static: float = _f(0.9, "Fraction of GPU memory SGLang reserves for weights + KV cache, in (0, 1].")
    max_running_requests: Optional[int] = _f(None, "Cap on requests decoded at once per server; None = SGLang decides.")


@dataclass
class VLLMConfig:
    """vLLM settings (the seed's ``vllm``, the alternative backend; not wired into rollout workers yet)."""

    max_model_len: int = _f(32768, "vLLM context limit in tokens (the seed's max_model_len).")
    gpu_memory_utilization: float = _f(0.9, "Fraction of GPU memory vLLM may use, in (0, 1].")


@dataclass
class EvaluatorConfig:
    """Evaluation sampling: used by ``areal-async sft`` before and after training (RL runs don't evaluate yet).

    Accuracy is the mean reward (reward.fn) over all samples = pass@1 averaged over n_samples
    (seed: 32 samples; SFT models at temperature 0.6, top_p 0.95; RL models at 1.0)."""

    enabled: bool = _f(True, "Run the evaluation (off for models the embedded torch engine cannot sample in reasonable time).")
    n_samples: int = _f(1, "Samples per problem; accuracy averages over them (pass@1).")
    greedy: bool = _f(True, "Greedy decoding (then n_samples must be 1: greedy samples are identical).")
    temperature: float = _f(1.0, "Sampling temperature when not greedy.")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1] when not greedy.")
    max_new_tokens: int = _f(0, "Generated tokens per sample; 0 = gconfig.max_new_tokens.")
    max_problems: int = _f(0, "Evaluate at most this many problems per split (its first ones: seeded order for tiny_arith, file order for jsonl); 0 = all.")


@dataclass
class SFTConfig:
    """Standalone supervised fine-tuning (``areal-async sft``): loss on answer tokens only, packed micro-batches."""

    steps: int = _f(0, "Optimizer steps; 0 derives them from epochs: ceil(epochs * examples / batch_size).")
    epochs: float = _f(1.0, "Passes over the training examples when steps is 0.")
    batch_size: int = _f(16, "(prompt, answer) examples per optimizer step, split into micro-batches by actor.mb_spec.")
    optimizer: OptimizerConfig = _sub(OptimizerConfig, "SFT optimizer and lr schedule (total steps = the SFT steps).")
    save_freq_steps: int = _f(0, "Atomic checkpoint to RUN_DIR/checkpoints every N steps, saver.keep_last kept (0 disables); the final model always goes to RUN_DIR/model.")
    holdout: int = _f(0, "Problems held out of training (the last ones of the seeded order) and evaluated separately; 0 = none.")


@dataclass
class SaverConfig:
    """Periodic checkpoints (model in HF safetensors, optimizer, scheduler ledger, cursor, RNG)."""

    freq_steps: int = _f(0, "Save every N trainer steps (0 disables).")
    freq_secs: float = _f(0.0, "Save when this many seconds passed since the last save (0 disables).")
    keep_last: int = _f(2, "Complete checkpoints kept.")


@dataclass
class RecoverConfig:
    """Resume from checkpoints."""

    mode: str = _f("disabled", "disabled | auto (resume from the newest complete checkpoint if any) | resume (must exist).")


@dataclass
class StatsLoggerConfig:
    """Progress output."""

    progress: bool = _f(True, "Live progress line on the supervisor's terminal.")


@dataclass
class ExperimentConfig:
    """A whole run: what `areal-async run CONFIG` builds a fleet from."""

    experiment_name: str = _f("areal-async", "Name shown in logs.")
    seed: int = _f(1, "Global seed (data order, model init, sampling).")
    total_train_steps: int = _f(100, "RL trainer steps; the run ends after this many.")
    model: ModelConfig = _sub(ModelConfig, "Policy model.")
    train_dataset: DatasetConfig = _sub(DatasetConfig, "Training prompts.")
    gconfig: GenerationConfig = _sub(GenerationConfig, "Sampling.")
    rollout: RolloutConfig = _sub(RolloutConfig, "Rollout fleet and staleness.")
    actor: ActorConfig = _sub(ActorConfig, "Policy optimization.")
    reward: RewardConfig = _sub(RewardConfig, "Reward function and pool.")
    cluster: ClusterConfig = _sub(ClusterConfig, "Fleet shape and control plane.")
    tensor_channel: TensorChannelConfig = _sub(TensorChannelConfig, "Tensor transport.")
    sft_warmup: SFTWarmupConfig = _sub(SFTWarmupConfig, "Supervised warm-up before RL.")
    ref: RefConfig = _sub(RefConfig, "Reference model of the KL penalty.")
    sglang: SGLangConfig = _sub(SGLangConfig, "SGLang server settings.")
    vllm: VLLMConfig = _sub(VLLMConfig, "vLLM settings.")
    evaluator: EvaluatorConfig = _sub(EvaluatorConfig, "Evaluation sampling.")
    sft: SFTConfig = _sub(SFTConfig, "Standalone SFT.")
    saver: SaverConfig = _sub(SaverConfig, "Checkpointing.")
    recover: RecoverConfig = _sub(RecoverConfig, "Resuming.")
    stats_logger: StatsLoggerConfig = _sub(StatsLoggerConfig, "Progress output.")

    def validate(self) -> "ExperimentConfig":
        _validate(self)
        return self


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

_LEVELS = ("group", "batch", "none")


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def _validate(c: ExperimentConfig) -> None:
    _check(c.total_train_steps >= 1, "total_train_steps", c.total_train_steps, "an integer >= 1")
    m = c.model
    _check(m.arch in ("llama", "qwen2"), "model.arch", m.arch, "'llama' or 'qwen2'")
    _check(m.dtype in ("float32", "bfloat16", "float16"), "model.dtype", m.dtype, "float32 | bfloat16 | float16")
    _check(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size", m.hidden_size,
           f"a multiple of model.num_attention_heads={m.num_attention_heads}")
    _check(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
           m.num_key_value_heads, "a divisor of model.num_attention_heads")
    d = c.train_dataset
    _check(d.type in ("tiny_arith", "jsonl"), "train_dataset.type", d.type, "'tiny_arith' or 'jsonl'")
    _check(d.type != "jsonl" or bool(d.path), "train_dataset.path", d.path, "a jsonl path when type is 'jsonl'")
    _check(d.batch_size >= 1, "train_dataset.batch_size", d.batch_size, "an integer >= 1")
    _check(d.max_operand >= 1, "train_dataset.max_operand", d.max_operand, "an integer >= 1")
    _check(bool(d.ops) and set(d.ops) <= set("+-*"), "train_dataset.ops", d.ops, "a non-empty string of '+-*'")
    g = c.gconfig
    _check(g.n_samples >= 1, "gconfig.n_samples", g.n_samples, "an integer >= 1")
    _check(g.max_new_tokens >= 1, "gconfig.max_new_tokens", g.max_new_tokens, "an integer >= 1")
    _check(g.greedy or g.temperature > 0, "gconfig.temperature", g.temperature, "> 0 (or gconfig.greedy=true)")
    _check(0 < g.top_p <= 1, "gconfig.top_p", g.top_p, "a number in (0, 1]")
    r = c.rollout
    _check(r.backend.split(":")[0] in ("torch", "sglang"), "rollout.backend", r.backend, "'torch' or 'sglang[:dN]'")
    _check(r.max_head_offpolicyness >= 0, "rollout.max_head_offpolicyness", r.max_head_offpolicyness, "an integer >= 0")
    _check(r.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts", r.max_concurrent_rollouts, "an integer >= 1")
    _check(r.max_batch_groups >= 1, "rollout.max_batch_groups", r.max_batch_groups, "an integer >= 1")
    a = c.actor
    _check(a.mb_spec.max_tokens_per_mb >= 1, "actor.mb_spec.max_tokens_per_mb", a.mb_spec.max_tokens_per_mb, "an integer >= 1")
    _check(a.mb_spec.oversize in ("error", "own_mb"), "actor.mb_spec.oversize", a.mb_spec.oversize, "'error' or 'own_mb'")
    _check(a.optimizer.lr > 0, "actor.optimizer.lr", a.optimizer.lr, "> 0")
    _check(a.optimizer.lr_scheduler_type in ("constant", "linear", "cosine"), "actor.optimizer.lr_scheduler_type",
           a.optimizer.lr_scheduler_type, "constant | linear | cosine")
    _check(0 <= a.optimizer.warmup_steps_proportion < 1, "actor.optimizer.warmup_steps_proportion",
           a.optimizer.warmup_steps_proportion, "a number in [0, 1)")
    _check(a.optimizer.gradient_clipping >= 0, "actor.optimizer.gradient_clipping", a.optimizer.gradient_clipping, ">= 0")
    _check(a.kl_ctl >= 0, "actor.kl_ctl", a.kl_ctl, ">= 0")
    _check(a.eps_clip > 0, "actor.eps_clip", a.eps_clip, "> 0")
    for name in ("reward_norm", "adv_norm"):
        nc = getattr(a, name)
        _check(nc.mean_level in _LEVELS, f"actor.{name}.mean_level", nc.mean_level, "group | batch | none")
        _check(nc.std_level in _LEVELS, f"actor.{name}.std_level", nc.std_level, "group | batch | none")
    _check(0 <= a.discount <= 1, "actor.discount", a.discount, "a number in [0, 1]")
    _check(0 <= a.gae_lambda <= 1, "actor.gae_lambda", a.gae_lambda, "a number in [0, 1]")
    _check(a.ppo_n_minibatches >= 1, "actor.ppo_n_minibatches", a.ppo_n_minibatches, "an integer >= 1")
    _check(a.ppo_n_minibatches <= d.batch_size * g.n_samples, "actor.ppo_n_minibatches", a.ppo_n_minibatches,
           f"<= samples per step ({d.batch_size * g.n_samples})")
    rs = a.rejection_sampling
    _check(rs.metric in ("ratio", "none"), "actor.rejection_sampling.metric", rs.metric, "'ratio' or 'none'")
    _check(rs.upper > 1, "actor.rejection_sampling.upper", rs.upper, "> 1")
    _check(rs.mode in ("mask", "clamp"), "actor.rejection_sampling.mode", rs.mode, "'mask' or 'clamp'")
    _check(c.reward.timeout_s > 0, "reward.timeout_s", c.reward.timeout_s, "> 0")
    _check(c.reward.n_procs >= 1, "reward.n_procs", c.reward.n_procs, "an integer >= 1")
    _check(c.reward.memory_limit_mb == 0 or c.reward.memory_limit_mb >= 256, "reward.memory_limit_mb",
           c.reward.memory_limit_mb, "0 (no limit) or >= 256")
    _check(":" in c.reward.fn, "reward.fn", c.reward.fn, "a dotted path 'module:function'")
    cl = c.cluster
    _check(cl.n_rollout_workers >= 1, "cluster.n_rollout_workers", cl.n_rollout_workers, "an integer >= 1")
    _check(cl.n_reward_workers >= 1, "cluster.n_reward_workers", cl.n_reward_workers, "an integer >= 1")
    _check(cl.launcher in ("local", "ray", "slurm"), "cluster.launcher", cl.launcher, "local | ray | slurm")
    _check(cl.control in ("ipc", "tcp"), "cluster.control", cl.control, "'ipc' or 'tcp'")
    _check(cl.heartbeat_s > 0, "cluster.heartbeat_s", cl.heartbeat_s, "> 0")
    _check(cl.worker_timeout_s > cl.heartbeat_s, "cluster.worker_timeout_s", cl.worker_timeout_s, "> cluster.heartbeat_s")
    _check(cl.device in ("cpu", "cuda"), "cluster.device", cl.device, "'cpu' or 'cuda'")
    _check(cl.torch_threads >= 1, "cluster.torch_threads", cl.torch_threads, "an integer >= 1")
    _check(cl.max_restarts >= 0, "cluster.max_restarts", cl.max_restarts, "an integer >= 0")
    for role, spec in dataclasses.asdict(cl.cpu_affinity).items():
        _check(spec == "" or _cpu_list_ok(spec), f"cluster.cpu_affinity.{role}", spec,
               "a cpu list such as '0', '1-3' or '0,2' (or '' for no pinning)")
    tc = c.tensor_channel
    kinds = ("shm", "zmq", "gloo", "nccl", "cuda_ipc")
    _check(tc.weights in kinds, "tensor_channel.weights", tc.weights, " | ".join(kinds))
    _check(tc.trajectories in kinds, "tensor_channel.trajectories", tc.trajectories, " | ".join(kinds))
    _check(tc.bucket_mb > 0, "tensor_channel.bucket_mb", tc.bucket_mb, "> 0")
    _check(c.sft_warmup.steps >= 0, "sft_warmup.steps", c.sft_warmup.steps, "an integer >= 0")
    _check(c.saver.freq_steps >= 0, "saver.freq_steps", c.saver.freq_steps, "an integer >= 0")
    _check(c.saver.keep_last >= 1, "saver.keep_last", c.saver.keep_last, "an integer >= 1")
    _check(c.recover.mode in ("disabled", "auto", "resume"), "recover.mode", c.recover.mode, "disabled | auto | resume")
    _validate_sections(c)


_BACKEND_RE = re.compile(r"^(torch|sglang)(:d([1-9][0-9]*))?$")
_DTYPES = ("float32", "bfloat16", "float16")


def _validate_sections(c: ExperimentConfig) -> None:
    """Checks of the sections that mirror the seed's skeleton (ref, sglang, vllm, evaluator, sft, cluster size)."""
    _validate_fleet_shape(c)
    _validate_servers(c)
    _validate_evaluator(c.evaluator)
    _validate_sft(c.sft)
    r = c.ref
    _check(r.dtype in _DTYPES, "ref.dtype", r.dtype, " | ".join(_DTYPES))
    _check(r.mb_spec.max_tokens_per_mb >= 1, "ref.mb_spec.max_tokens_per_mb", r.mb_spec.max_tokens_per_mb, "an integer >= 1")
    _check(r.mb_spec.oversize in ("error", "own_mb"), "ref.mb_spec.oversize", r.mb_spec.oversize, "'error' or 'own_mb'")


def rollout_dp_degree(backend: str) -> int:
    """'sglang:d4' -> 4; a backend without ':dN' -> 1."""
    m = _BACKEND_RE.match(backend)
    return int(m.group(3)) if m and m.group(3) else 1


def _validate_fleet_shape(c: ExperimentConfig) -> None:
    cl = c.cluster
    _check(cl.n_nodes >= 1, "cluster.n_nodes", cl.n_nodes, "an integer >= 1")
    _check(cl.n_gpus_per_node >= 1, "cluster.n_gpus_per_node", cl.n_gpus_per_node, "an integer >= 1")
    b = c.rollout.backend
    _check(_BACKEND_RE.match(b) is not None, "rollout.backend", b, "'torch', 'sglang' or 'sglang:dN' with N >= 1")
    gpus = cl.n_nodes * cl.n_gpus_per_node
    _check(not b.startswith("sglang") or rollout_dp_degree(b) <= gpus, "rollout.backend", b,
           f"a data-parallel degree <= cluster.n_nodes * cluster.n_gpus_per_node = {gpus}")
    _check(not b.startswith("sglang") or cl.device == "cuda", "cluster.device", cl.device,
           f"'cuda' with rollout.backend={b!r}")


def _validate_servers(c: ExperimentConfig) -> None:
    s, v = c.sglang, c.vllm
    _check(s.context_length >= 1, "sglang.context_length", s.context_length, "an integer >= 1")
    _check(0 < s.mem_fraction_static <= 1, "sglang.mem_fraction_static", s.mem_fraction_static, "a number in (0, 1]")
    _check(s.max_running_requests is None or s.max_running_requests >= 1, "sglang.max_running_requests",
           s.max_running_requests, "null or an integer >= 1")
    _check(v.max_model_len >= 1, "vllm.max_model_len", v.max_model_len, "an integer >= 1")
    _check(0 < v.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", v.gpu_memory_utilization, "a number in (0, 1]")
    need = c.train_dataset.max_prompt_len + c.gconfig.max_new_tokens
    _check(not c.rollout.backend.startswith("sglang") or s.context_length >= need, "sglang.context_length",
           s.context_length, f">= train_dataset.max_prompt_len + gconfig.max_new_tokens = {need}")


def _validate_evaluator(e: EvaluatorConfig) -> None:
    _check(e.n_samples >= 1, "evaluator.n_samples", e.n_samples, "an integer >= 1")
    _check(not e.greedy or e.n_samples == 1, "evaluator.n_samples", e.n_samples,
           "1 when evaluator.greedy=true (greedy samples are identical)")
    _check(e.greedy or e.temperature > 0, "evaluator.temperature", e.temperature, "> 0 (or evaluator.greedy=true)")
    _check(0 < e.top_p <= 1, "evaluator.top_p", e.top_p, "a number in (0, 1]")
    _check(e.max_new_tokens >= 0, "evaluator.max_new_tokens", e.max_new_tokens, "an integer >= 0 (0 = gconfig.max_new_tokens)")
    _check(e.max_problems >= 0, "evaluator.max_problems", e.max_problems, "an integer >= 0 (0 = all)")


def _validate_sft(s: SFTConfig) -> None:
    _check(s.steps >= 0, "sft.steps", s.steps, "an integer >= 0 (0 = derive from sft.epochs)")
    _check(s.epochs > 0, "sft.epochs", s.epochs, "> 0")
    _check(s.batch_size >= 1, "sft.batch_size", s.batch_size, "an integer >= 1")
    _check(s.save_freq_steps >= 0, "sft.save_freq_steps", s.save_freq_steps, "an integer >= 0")
    _check(s.holdout >= 0, "sft.holdout", s.holdout, "an integer >= 0")
    o = s.optimizer
    _check(o.lr > 0, "sft.optimizer.lr", o.lr, "> 0")
    _check(o.eps > 0, "sft.optimizer.eps", o.eps, "> 0")
    _check(0 <= o.beta1 < 1, "sft.optimizer.beta1", o.beta1, "a number in [0, 1)")
    _check(0 <= o.beta2 < 1, "sft.optimizer.beta2", o.beta2, "a number in [0, 1)")
    _check(o.weight_decay >= 0, "sft.optimizer.weight_decay", o.weight_decay, ">= 0")
    _check(o.lr_scheduler_type in ("constant", "linear", "cosine"), "sft.optimizer.lr_scheduler_type",
           o.lr_scheduler_type, "constant | linear | cosine")
    _check(0 <= o.warmup_steps_proportion < 1, "sft.optimizer.warmup_steps_proportion", o.warmup_steps_proportion,
           "a number in [0, 1)")
    _check(0 <= o.min_lr_ratio <= 1, "sft.optimizer.min_lr_ratio", o.min_lr_ratio, "a number in [0, 1]")
    _check(o.gradient_clipping >= 0, "sft.optimizer.gradient_clipping", o.gradient_clipping, ">= 0")


# --------------------------------------------------------------------------------------------
# building from dicts, YAML and overrides
# --------------------------------------------------------------------------------------------


def _type_of(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _coerce(key: str, value: Any, tp: Any, base: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(key, value, args[0])
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, key + ".", base)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is CpuList:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)  # stored as a plain str (YAML dumps it as one)
        raise ConfigError(f"{key}={value!r}: expected a cpu list such as '0', '1-3' or '0,2'")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: expected a string")
    if tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
        raise ConfigError(f"{key}={value!r}: expected a list")
    return value


def _build(cls: type, data: dict, prefix: str = "", base: Any = None) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known in this section: {', '.join(sorted(names))})")
    obj = base if base is not None else cls()  # partial sections keep the parent's defaults
    for k, v in data.items():
        setattr(obj, k, _coerce(prefix + k, v, _type_of(cls, k), getattr(obj, k)))
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a','b','c'], parsed YAML value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted key=value, e.g. rollout.max_head_offpolicyness=0")
    key, raw = text.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    return key.split("."), value


def _set_dotted(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(parts)}: '{p}' is not a section")
    node[parts[-1]] = value


def from_dict(data: dict, overrides: list[str] = ()) -> ExperimentConfig:
    data = dict(data or {})
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for text in overrides:
        parts, value = parse_override(text)
        _set_dotted(data, parts, value)
    return _build(ExperimentConfig, data).validate()


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Read a YAML preset, apply dotted overrides, validate."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return from_dict(data, overrides)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, help) for every leaf field: the reference of all knobs."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _type_of(cls, f.name)
        if dataclasses.is_dataclass(tp):
            out += describe(tp, prefix + f.name + ".")
        else:
            out.append((prefix + f.name, f.metadata.get("help", "")))
    return out


def _cpu_list_ok(spec: str) -> bool:
    from areal_async.runtime.affinity import parse_cpu_list

    try:
        parse_cpu_list(spec)
    except ValueError:
        return False
    return True
