"""A rollout worker, built from the run directory: an engine (the embedded torch engine, or the SGLang or
vLLM servers this worker owns behind a ``RemoteEngine``) behind the rollout service."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional
from pathlib import Path

import torch
import zmq.asyncio

from areal_async.app.workers.channels import trajectory_channel, weight_channel
from areal_async.app.workers.wiring import control_client, load_run
from areal_async.base.endpoints import NODE_HOST_ENV
from areal_async.base.records import RewardRecord
from areal_async.base.manifest import RunManifest
from areal_async.base import cores
from areal_async.base.process import setup_torch_process
from areal_async.config import ExperimentConfig, server_addresses
from areal_async.base.plugins import load_callable
from areal_async.models import lora
from areal_async.models.lora import LORA_BASE
from areal_async.models.tiny import build_model, load_model
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tokenizer import batch_decoder
from areal_async.data.prompts import load_problems, prompt_encoder
from areal_async.rollout.agent import AgentWorkflow, PromptTexts, trace_record
from areal_async.rollout.episodes import Episodes, ErrorWindow
from areal_async.rollout.openai_server import OpenAIServer
from areal_async.rollout.clients.server_auth import server_key
from areal_async.rollout.clients.remote import RemoteEngine, servers_of
from areal_async.reward.pool import RewardPool
from areal_async.rollout.record import RolloutRecord
from areal_async.rollout.service import RolloutService, message_bytes
from areal_async.rollout.clients.sglang_client import SGLangClient
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.rollout.clients.vllm_client import ProbeRef, VLLMClient
from areal_async.rollout.servers.vllm_server import SERVED_NAME
from areal_async.supervisor.placement import place, server_group_backend, shape_of

PROBE_TEXT = "7+8=\\boxed{15}"  # the fixed sequence whose logprobs check a vLLM server's weights


def build_rollout(run_dir: str | Path, worker_id: str, index: int) -> RolloutService:
    cfg, ep = load_run(run_dir)
    setup_torch_process(cfg.cluster)
    if cfg.rollout.backend == "torch":  # the embedded engine computes here; a server client does not
        cores.install_for(run_dir, cfg.cluster, "rollout", index)
    tok = policy_tokenizer(cfg.model)
    max_active = max(1, cfg.rollout.max_concurrent_rollouts // cfg.cluster.n_rollout_workers + 1)
    if cfg.rollout.backend.startswith("sglang"):
        engine = sglang_engine(cfg, ep, run_dir, worker_id, index, max_in_flight=max_active * cfg.gconfig.n_samples)
    elif cfg.rollout.backend.startswith("vllm"):
        engine = vllm_engine(cfg, ep, tok, run_dir, worker_id, index, max_in_flight=max_active * cfg.gconfig.n_samples)
    else:
        engine = torch_engine(cfg, tok, index, run_dir)
    ctx = zmq.asyncio.Context()
    traj = trajectory_channel(cfg, ep, "sender", rank=index + 1)
    weights = weight_channel(cfg, ep, "receiver", rank=index + 1)
    return RolloutService(
        worker_id,
        control_client(ctx, cfg, ep, "rollout", worker_id),
        ctx,
        engine,
        batch_decoder(tok),
        traj,
        weights,
        ep.rewards,
        max_active,
        **(agent_parts if cfg.rollout.agent else workflow_parts)(cfg, tok, run_dir, worker_id),
        message_bytes=message_bytes(cfg.tensor_channel.max_message_mb),
        record=RolloutRecord(run_dir, worker_id),  # every run: what areal-async verify reads
        question=prompt_texts(cfg, tok) if cfg.reward.judge else None,  # the judge reads the question
    )


def workflow_parts(
    cfg: ExperimentConfig, tok, run_dir: str | Path, worker_id: str, workflow=None, name: str = ""
) -> dict:
    """The rollout workflow (``rollout.workflow``, or the given one), its tokenizer, its scorer (reward.fn in
    this worker's own killable processes) and the record of what it scored; nothing for plain sampling."""
    if not cfg.rollout.workflow and workflow is None:
        return {}
    r = cfg.rollout
    workflow, name = (workflow, name) if workflow is not None else (load_callable(r.workflow)(), r.workflow)
    errors = ErrorWindow(name, r.max_workflow_errors, r.workflow_error_window)
    episodes = Episodes(workflow, name, r.episode_timeout_s, errors)
    pool = RewardPool.from_config(cfg.reward)

    async def score(completion: str, solutions: list, prompt: str | None = None) -> float:
        return (await pool.score(completion, solutions, prompt)).score

    record = RewardRecord(run_dir, worker_id)
    return {"episodes": episodes, "tokenizer": tok, "score": score, "reward_record": record}


def agent_parts(cfg: ExperimentConfig, tok, run_dir: str | Path, worker_id: str) -> dict:
    """``rollout.agent``: the agent workflow over this worker's OpenAI-compatible endpoint (``rollout/agent.py``),
    its episodes counted like a workflow's; the endpoint's key is the run's server key."""
    r, g = cfg.rollout, cfg.gconfig
    host = os.environ.get(NODE_HOST_ENV) or cfg.cluster.host
    limits = (g.max_new_tokens, max(r.agent_max_tokens, g.max_new_tokens))
    server = OpenAIServer(tok, template_name(tok), limits, host, server_key())
    traces = trace_record(run_dir, worker_id) if r.dump_to_file else None
    workflow = AgentWorkflow(
        load_callable(r.agent), r.agent, server, r.agent_drift, server_key(), prompt_texts(cfg, tok), traces
    )
    return workflow_parts(cfg, tok, run_dir, worker_id, workflow, r.agent)


def prompt_texts(cfg: ExperimentConfig, tok) -> PromptTexts:
    """prompt ids -> the dataset's prompt text (an agent's ``task["prompt"]``, the judge's question)."""
    d = cfg.train_dataset
    return PromptTexts(lambda: load_problems(d, cfg.seed), prompt_encoder(tok, d.template), tok)


def template_name(tok) -> str:
    """What drift is counted under: the tokenizer's name and a digest of its chat template."""
    text = getattr(tok, "chat_template", None) or ""
    name = Path(str(getattr(tok, "name_or_path", "") or "tokenizer")).name
    return f"{name}#{hashlib.sha1(text.encode()).hexdigest()[:8]}" if text else f"{name}#no-template"


def torch_engine(cfg: ExperimentConfig, tok, index: int, run_dir: str | Path | None = None) -> TorchEngine:
    """The embedded engine; it starts without weights (version -1): version 0 comes from the trainer (in a
    LoRA run, its adapter; the base is read from the run directory at the first one, so a LoRA run needs it)."""
    model = torch_engine_model(cfg, tok)
    spec = lora.LoraSpec.of(cfg.actor.lora)
    adapter = None
    if spec is not None:
        if run_dir is None:
            raise ValueError("actor.lora.rank > 0: the engine needs run_dir (the base weights are read from it)")
        base = Path(run_dir) / LORA_BASE
        adapter = lora.EngineAdapter(
            model, spec, cfg.actor.lora.engine_merge, base=lambda: load_model(base, cfg.model.dtype).state_dict()
        )
    return TorchEngine(
        model,
        tok,
        device=cfg.cluster.device,
        seed=cfg.seed * 1000 + index,
        max_batch_groups=cfg.rollout.max_batch_groups,
        kv_cache_bytes=int(cfg.rollout.kv_cache_mb * (1 << 20)),
        adapter=adapter,
        on_weights=cfg.rollout.on_weights,
        token_entropy=cfg.rollout.token_entropy,
        linears=cfg.rollout.engine_linears,
    )


def torch_engine_model(cfg: ExperimentConfig, tok):
    """A model of the policy's shape for an engine that receives its weights later (loaded or built)."""
    return load_model(cfg.model.path, cfg.model.dtype) if cfg.model.path else build_model(cfg.model, len(tok), cfg.seed)


def sglang_engine(
    cfg: ExperimentConfig, ep: RunManifest, run_dir: str | Path, worker_id: str, index: int, max_in_flight: int
) -> RemoteEngine:
    """A RemoteEngine over the SGLang servers this worker owns (started by the supervisor, or sglang.addresses)."""
    s = cfg.sglang
    mine = servers_of(ep.servers, index, cfg.cluster.n_rollout_workers)
    clients = [
        SGLangClient(
            a,
            name=f"{worker_id}-s{j}",
            pause_mode=s.pause_mode,
            weight_sync=s.weight_sync,
            group_backend=server_group_backend_of(cfg, worker_id, j, index),
            group_host=os.environ.get(NODE_HOST_ENV) or cfg.cluster.host,  # this worker's node
            bucket_mb=cfg.tensor_channel.bucket_mb,
            request_timeout_s=s.request_timeout_s,
            update_timeout_s=s.update_timeout_s,
            weight_update_session=s.weight_update_session,
            disk_dir=str(Path(run_dir) / "weights" / worker_id),
            lora=lora.LoraSpec.of(cfg.actor.lora),
            lora_base=str(Path(run_dir) / LORA_BASE),
        )
        for j, a in enumerate(mine)
    ]
    return RemoteEngine(
        clients,
        max_in_flight=max_in_flight,
        down_timeout_s=s.server_down_timeout_s,
        ready_timeout_s=s.update_timeout_s,
        on_weights=cfg.rollout.on_weights,
    )


def server_group_backend_of(cfg: ExperimentConfig, worker_id: str, j: int, index: int) -> str:
    """gloo on CPU; on CUDA the placement's choice for this worker and its j-th server (gloo when they share
    a GPU, which NCCL refuses; attached servers: gloo, their GPUs are unknown)."""
    if cfg.cluster.device != "cuda" or server_addresses(cfg):
        return "gloo"
    placement = place(shape_of(cfg, environ={}))  # pure; the GPU overlap is the same under any visible-list mapping
    server = f"{cfg.rollout.backend.split(':')[0]}-{index + j * cfg.cluster.n_rollout_workers}"  # servers_of
    return server_group_backend(placement[worker_id], placement[server])


def vllm_engine(
    cfg: ExperimentConfig, ep: RunManifest, tok, run_dir: str | Path, worker_id: str, index: int, max_in_flight: int
) -> RemoteEngine:
    """A RemoteEngine over the vLLM servers this worker owns (started by the supervisor, or vllm.addresses)."""
    v = cfg.vllm
    mine = servers_of(ep.servers, index, cfg.cluster.n_rollout_workers)
    probe = ProbeReference(cfg, tok, Path(run_dir) / LORA_BASE) if v.probe else None
    clients = [
        VLLMClient(
            a,
            weights_dir=str(Path(run_dir) / "weights" / "vllm"),
            model=SERVED_NAME,
            keep_versions=v.keep_versions,
            probe_ids=probe.ids if probe else None,
            probe_expected=probe,
            probe_atol=v.probe_atol,
            probe_dtype=cfg.model.dtype,  # the servers' dtype: what the probe can hold them to
            request_timeout_s=v.request_timeout_s,
            update_timeout_s=v.update_timeout_s,
            lora=lora.LoraSpec.of(cfg.actor.lora),
            lora_base=str(Path(run_dir) / LORA_BASE),
        )
        for a in mine
    ]
    return RemoteEngine(
        clients,
        max_in_flight=max_in_flight,
        down_timeout_s=v.server_down_timeout_s,
        ready_timeout_s=v.startup_timeout_s,
        on_weights=cfg.rollout.on_weights,
    )


class ProbeReference:
    """The trainer's logprobs of the probe sequence under a version's weights (one HF forward, cached per
    version): what a vLLM server must answer after loading that version."""

    def __init__(self, cfg: ExperimentConfig, tok, lora_base: Optional[Path] = None):
        self.ids = [tok.bos_token_id, *tok.encode(PROBE_TEXT, add_special_tokens=False)]
        self.model = (
            load_model(cfg.model.path, "float32") if cfg.model.path else build_model(cfg.model, len(tok), cfg.seed)
        )
        self.model.eval()
        self.lock = threading.Lock()
        self.cache: dict[int, ProbeRef] = {}
        self.lora, self.lora_base = lora.LoraSpec.of(cfg.actor.lora), lora_base
        self._base: Optional[dict] = None

    def _full(self, state_dict: dict) -> dict:
        """A LoRA run's adapter merged into its base (read once from the run directory); full weights as given."""
        if self.lora is None:
            return state_dict
        if self._base is None:
            self._base = load_model(self.lora_base, "float32").state_dict()
        return lora.merge_into(self._base, state_dict, self.lora)

    def __call__(self, version: int, state_dict: dict) -> ProbeRef:
        with self.lock:
            if version not in self.cache:
                self.model.load_state_dict(self._full(state_dict))
                self.cache = {version: probe_reference(self.model, self.ids)}
            return self.cache[version]


@torch.no_grad()
def probe_reference(model, ids: list[int]) -> ProbeRef:
    """The probe's reference (``vllm_client.ProbeRef``): one float32 forward, per position i >= 1 the logprob of
    ids[i], the most likely token and its lead over the runner-up."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)[:-1]
    top2 = logp.topk(2, dim=-1)
    return ProbeRef(
        [float(logp[i, t]) for i, t in enumerate(ids[1:])],
        top2.indices[:, 0].tolist(),
        (top2.values[:, 0] - top2.values[:, 1]).tolist(),
    )


@torch.no_grad()
def logprobs_of(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1: one full forward in float32."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i - 1, t]) for i, t in enumerate(ids) if i > 0]
