"""GPU check of vLLM's weight paths, run by scripts/gpu_check.sh with a CUDA vLLM environment's python.

Written against vLLM 0.32.0's source (``vllm/distributed/weight_transfer/nccl_engine.py``, ``clients.py``,
``base.py``, ``entrypoints/rl/online/api_router.py``); NOT RUN here (no GPU this session).

1. disk: a tiny Llama served on GPU 0 (``VLLM_SERVER_DEV_MODE=1``); new weights written as safetensors and
   loaded with ``/pause`` -> ``/collective_rpc reload_weights`` -> ``/reset_prefix_cache`` -> ``/resume``
   (the path ``rollout.backend=vllm`` uses); the server's prompt logprobs must equal the new model's.
2. nccl (needs 2 GPUs: NCCL refuses two ranks on one device): the server on GPU 1 started with
   ``--weight-transfer-config '{"backend": "nccl"}'``; this process on GPU 0 is rank 0 of a 2-rank group
   built by vLLM's own ``NCCLTrainerWeightTransferEngine.trainer_init`` over ``HTTPVLLMWeightSyncClient``
   (``/init_weight_transfer_engine``, then per update ``/start_weight_update``, ``/update_weights`` beside the
   packed broadcast, ``/finish_weight_update`` with the version); then the same logprob comparison and
   ``/weight_info`` must report the version.

Prints one JSON line per check ({"check", "ok", "max_abs_diff" | "skipped"}); exits 1 if a run check failed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ATOL = 2e-3
IDS = [1, 30, 12, 41, 29, 33, 5, 17, 22, 9, 40, 2]


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def post(url: str, path: str, body: dict | None = None, timeout: float = 300.0):
    req = urllib.request.Request(
        url + path, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: Path, gpu: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", CUDA_VISIBLE_DEVICES=str(gpu))
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--gpu-memory-utilization",
        "0.2",
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t = time.monotonic()
    while time.monotonic() - t < 600:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}") from None
            time.sleep(1)
    raise RuntimeError("vLLM not healthy after 600 s")


@torch.no_grad()
def expected(model) -> list[float]:
    logp = torch.log_softmax(model(input_ids=torch.tensor([IDS])).logits[0].float(), -1)
    return [float(logp[i - 1, t]) for i, t in enumerate(IDS) if i > 0]


def served(url: str) -> list[float]:
    r = post(url, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
    plp = r["choices"][0]["prompt_logprobs"]
    return [float(plp[i][str(t)]["logprob"]) for i, t in enumerate(IDS) if i > 0]


def compare(name: str, url: str, model) -> bool:
    diff = max(abs(a - b) for a, b in zip(served(url), expected(model)))
    print(json.dumps({"check": name, "ok": diff <= ATOL, "max_abs_diff": diff}), flush=True)
    return diff <= ATOL


def disk_check(work: Path) -> bool:
    a, b = tiny(1), tiny(2)
    a.save_pretrained(work / "model")
    b.save_pretrained(work / "v1")
    proc, url = start(work / "model", 0, [])
    try:
        ok = compare("vllm_disk_v0", url, a)
        post(url, "/pause")
        post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(work / "v1")}})
        post(url, "/reset_prefix_cache")
        post(url, "/resume")
        return compare("vllm_disk_reload_v1", url, b) and ok
    finally:
        os.killpg(proc.pid, 9)


def nccl_check(work: Path) -> bool:
    if torch.cuda.device_count() < 2:
        print(json.dumps({"check": "vllm_nccl", "skipped": "needs 2 GPUs (NCCL refuses two ranks on one device)"}))
        return True
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    proc, url = start(work / "model", 1, ["--weight-transfer-config", json.dumps({"backend": "nccl"})])
    try:
        torch.cuda.set_device(0)
        b = tiny(3).cuda()
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(b)
        )
        post(url, "/pause")
        t = time.monotonic()
        engine.send_weights()
        post(url, "/update_weight_version", {"new_version": "1"})
        post(url, "/reset_prefix_cache")
        post(url, "/resume")
        print(json.dumps({"check": "vllm_nccl_send_s", "value": time.monotonic() - t}), flush=True)
        with urllib.request.urlopen(url + "/weight_info", timeout=30) as r:
            version = json.loads(r.read())["weight_version"]
        ok = compare("vllm_nccl_v1", url, b.cpu()) and version == "1"
        print(json.dumps({"check": "vllm_nccl_weight_version", "ok": version == "1", "value": version}))
        engine.shutdown()
        return ok
    finally:
        os.killpg(proc.pid, 9)


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        ok = disk_check(Path(d))
        ok = nccl_check(Path(d)) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
