"""Where a run's weights travel on each update, hop by hop, and what each GPU holds: the dry run's account, and
the preflight's refusal of a server GPU that cannot hold what the processes beside the server put on it.

The layout of the GPU presets (issue 36, item 5). A rollout worker owns its servers and sits on their node (and,
in the placement, on their GPUs); it receives each version from trainer rank 0 and relays it to its servers.
Two layouts remove the wasted hops of ``weights: nccl`` (trainer GPU -> worker GPU -> worker host -> gloo ->
SGLang host -> SGLang GPU, the worker keeping two versions in the ~8 GiB SGLang leaves):

- trainer rank 0 in each server's NCCL group (AReaL's way): one GPU-to-GPU hop, but trainer rank 0 then
  blocks in a broadcast to every server, a server that dies mid-update wedges the trainer's communicator, and
  a restarted server can only be revived by the trainer (the worker holds no copy to push);
- the worker receives over shm (no GPU copy: the version stays in host memory the trainer wrote once), and
  its gloo broadcast lands in SGLang's GPU tensor (SGLang stages it on its host). Taken here: the server GPU
  keeps all it has left for SGLang, the worker revives a restarted server from its own host copy, the trainer
  waits for nobody, and the channels stay restartable (shm/zmq, ``plan.restart_blocker``). The price is the
  host hop into SGLang: a gloo loopback of the whole state dict per server and update.

Trajectories follow the same argument: the worker's tokens come from SGLang's HTTP answers, host tensors;
NCCL would copy them host -> worker GPU -> trainer GPU -> host (the trainer packs on the host): shm.

Memory per GPU. A server takes its fraction: SGLang ``mem_fraction_static`` of the GPU for weights and KV
cache, and keeps the rest for its activations and CUDA graphs: it sizes the KV pool to leave that slack
(0.5.23 ``mem_cache/kv_cache_configurator.py`` line 3007, ``pre_model_load_memory * (1 -
mem_fraction_static)``), and reckons its own need there as 512 MiB + 1.5 MiB per prefill token + CUDA graphs, at
least 10 GiB on a GPU over 60 GiB (``arg_groups/memory_hook.py`` lines 66 and 309-315). vLLM takes
``gpu_memory_utilization`` of the GPU, its activations included (0.32 ``v1/worker/utils.py`` ``request_memory``),
so the rest is free. What a process beside the server allocates comes out of that rest, later than the server
measured it: the preflight refuses a layout whose co-located bytes exceed it (``server_gpu_overflow``).

Figures are estimates from the shapes (``param_count``), stated as such in the account: a CUDA context
(``CUDA_CONTEXT``), a trainer rank's 16 bytes a parameter (float32 master, gradient, Adam's two moments) over
the FSDP2 ranks, activations not counted. None of this has run on a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from areal_async.config import ExperimentConfig, server_addresses
from areal_async.supervisor.placement import Slot, server_group_backend

GiB = 1 << 30
MiB = 1 << 20
CUDA_CONTEXT = GiB // 2  # a process's CUDA context and allocator slack: an order of magnitude (0.3-0.6 GiB seen)
ASSUMED_GPU_GIB = 80.0  # the GPU the presets were written for (one 8 x 80 GB node), when none is known
SGLANG_FLOOR_ABOVE_60GIB = 10 * GiB  # memory_hook.py line 315: max(reserved_mem, 10 * 1024) MiB
SGLANG_FLOOR_SMALL = 512 * MiB + 2048 * 3 * MiB // 2  # memory_hook.py 310: 512 + 1.5 x max(prefill tokens, 2048)
VERSIONS_HELD = 2  # a receiver keeps the version it runs on while the next one arrives (trainer VERSIONS_KEPT)
SHM_VERSIONS = VERSIONS_HELD + 1  # the shm publisher's segments: VERSIONS_KEPT held + the one being written
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Hop:
    """One leg of an update: from where, to where, how, and the bytes it moves per update and receiver."""

    src: str
    dst: str
    how: str
    nbytes: int

    def line(self) -> str:
        return f"{self.src} -> {self.dst}: {self.how}, {gb(self.nbytes)} per update"


@dataclass(frozen=True)
class Holding:
    """What one process keeps on one GPU: bytes (or a fraction of the GPU, for a server) and what they are."""

    who: str
    nbytes: int
    what: str
    fraction: float = 0.0


def gb(n: float) -> str:
    """Bytes in GiB (MiB below 0.1 GiB), two decimals."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / MiB:.1f} MiB"


def version_bytes(cfg: ExperimentConfig, params: int, lora_params: int = 0) -> int:
    """Bytes of one published version: the state dict in model.dtype (a LoRA run: the adapter alone)."""
    return (lora_params or params) * DTYPE_BYTES[cfg.model.dtype]


def _where(slot: Optional[Slot], who: str) -> str:
    if slot is None or not slot.gpus:
        return f"{who} (host)"
    return f"{who} (node {slot.node} GPU {','.join(map(str, slot.physical))})"


def weight_hops(cfg: ExperimentConfig, placement: dict[str, Slot], nbytes: int) -> list[Hop]:
    """The update's legs: trainer rank 0 to the rollout workers (``tensor_channel.weights``), then into the engine
    or its servers (``rollout.backend``), for worker 0 and its first server (the others repeat them)."""
    trainer, worker = _where(placement.get("trainer"), "trainer"), "rollout-0"
    w0 = placement.get(worker)
    kind, on_gpu = cfg.tensor_channel.weights, cfg.cluster.device == "cuda"
    worker_side = _where(w0, worker) if kind in ("nccl", "cuda_ipc") else f"{worker} (host)"
    out = _channel_hops(kind, trainer, worker_side, nbytes, on_gpu)
    return out + _engine_hops(cfg, placement, worker_side, nbytes)


def _channel_hops(kind: str, trainer: str, worker: str, n: int, on_gpu: bool) -> list[Hop]:
    d2h = "device-to-host copy, " if on_gpu else ""
    if kind == "shm":
        held = f"{SHM_VERSIONS} held at once: {gb(SHM_VERSIONS * n)} of /dev/shm"
        return [
            Hop(trainer, "/dev/shm", f"{d2h}packed once into a shared-memory segment ({held})", n),
            Hop("/dev/shm", worker, "mapped: zero copy", 0),
        ]
    how = {
        "zmq": f"{d2h}ZeroMQ frames, a copy per receiver",
        "gloo": f"{d2h}gloo broadcast (TCP)",
        "nccl": "NCCL broadcast into a GPU buffer on the worker (the worker keeps two versions there)",
        "cuda_ipc": "CUDA IPC handles: the worker maps the trainer's buffer (same GPU), zero copy",
    }[kind]
    return [Hop(trainer, worker, how, 0 if kind == "cuda_ipc" else n)]


def _engine_hops(cfg: ExperimentConfig, placement: dict[str, Slot], worker: str, n: int) -> list[Hop]:
    backend, lora = cfg.rollout.backend, bool(cfg.actor.lora.rank)
    if backend.startswith("vllm"):
        server = _where(placement.get("vllm-0"), "vllm-0")
        return [
            Hop(worker, "RUN_DIR/weights/vllm", "a safetensors file, written once per worker and version", n),
            Hop("RUN_DIR/weights/vllm", server, "/collective_rpc reload_weights: read from disk to the GPU", n),
        ]
    if not backend.startswith("sglang"):
        dst = _where(placement.get("rollout-0"), "rollout-0 engine")
        return [Hop(worker, dst, "copied into the embedded engine's model" + (" (adapter)" if lora else ""), n)]
    server = _where(placement.get("sglang-0"), "sglang-0")
    if lora or cfg.sglang.weight_sync == "disk":
        what = (
            "a PEFT adapter directory, /load_lora_adapter" if lora else "a safetensors file, /update_weights_from_disk"
        )
        return [Hop(worker, server, f"{what}: read from disk to the GPU", n)]
    backend_of = _group_backend(cfg, placement)
    d2h = "device-to-host copy into a host bucket, " if "GPU" in worker and backend_of == "gloo" else ""
    path = (
        "loopback TCP; SGLang stages each on its host, then copies it to its GPU"
        if backend_of == "gloo"
        else "GPU to GPU"
    )
    how = f"{d2h}{backend_of} broadcast in {cfg.tensor_channel.bucket_mb:g} MiB buckets, {path}"
    return [Hop(worker, server, how, n)]


def _group_backend(cfg: ExperimentConfig, placement: dict[str, Slot]) -> str:
    if cfg.cluster.device != "cuda" or server_addresses(cfg) or "sglang-0" not in placement:
        return "gloo"
    return server_group_backend(placement["rollout-0"], placement["sglang-0"])


# ---- sizes from the model's shape ------------------------------------------------------------------------


def model_shape(cfg: ExperimentConfig, vocab: int) -> dict:
    """The policy's shape: its config.json when model.path is set, else the built one's."""
    m = vars(cfg.model).copy()
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        m.update(yaml.safe_load((Path(cfg.model.path) / "config.json").read_text()) or {})
        vocab = int(m.get("vocab_size", vocab))
    h, heads = int(m["hidden_size"]), int(m["num_attention_heads"])
    kv = h // heads * int(m.get("num_key_value_heads") or heads)
    return {"h": h, "kv": kv, "inter": int(m["intermediate_size"]), "layers": int(m["num_hidden_layers"]),
            "vocab": vocab, "tied": bool(m.get("tie_word_embeddings"))}  # fmt: skip


def param_count(cfg: ExperimentConfig, vocab: int) -> int:
    """Parameters of the policy (its config.json when model.path is set, else the built shape)."""
    s = model_shape(cfg, vocab)
    h, kv, inter = s["h"], s["kv"], s["inter"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return s["vocab"] * h * (1 if s["tied"] else 2) + s["layers"] * per_layer + h


def lora_param_count(cfg: ExperimentConfig, vocab: int) -> int:
    """Parameters of a LoRA run's adapter: rank x (in + out) of each target layer (Llama/Qwen names); 0 without."""
    r = cfg.actor.lora.rank
    if not r:
        return 0
    s = model_shape(cfg, vocab)
    h, kv, inter = s["h"], s["kv"], s["inter"]
    sizes = {"q_proj": 2 * h, "o_proj": 2 * h, "k_proj": h + kv, "v_proj": h + kv, "gate_proj": h + inter,
             "up_proj": h + inter, "down_proj": h + inter}  # fmt: skip
    return s["layers"] * r * sum(sizes.get(t, 0) for t in cfg.actor.lora.target_modules)


# ---- memory per GPU --------------------------------------------------------------------------------------


def rollout_gpu_bytes(cfg: ExperimentConfig, placement: dict[str, Slot], nbytes: int, params: int) -> list[Holding]:
    """What a rollout worker allocates on its GPU: nothing unless a channel, its engine or its server group
    puts something there (then a CUDA context too)."""
    tc, who, parts = cfg.tensor_channel, "rollout-0", []
    if tc.weights == "nccl":
        parts.append(Holding(who, VERSIONS_HELD * nbytes, f"{VERSIONS_HELD} versions received over NCCL"))
    if not cfg.rollout.backend.startswith(("sglang", "vllm")):
        kv = int(cfg.rollout.kv_cache_mb * MiB)
        parts.append(Holding(who, params * DTYPE_BYTES[cfg.model.dtype] + kv, "the embedded engine's model + KV cache"))
    if cfg.rollout.backend.startswith("sglang") and _group_backend(cfg, placement) == "nccl":
        parts.append(Holding(who, int(tc.bucket_mb * MiB), "the bucket it broadcasts to its server"))
    if parts or "nccl" in (tc.weights, tc.trajectories) or tc.weights == "cuda_ipc":
        parts.append(Holding(who, CUDA_CONTEXT, "CUDA context"))
    return parts


def trainer_gpu_bytes(cfg: ExperimentConfig, rank: str, nbytes: int, params: int) -> list[Holding]:
    """A trainer rank: its share of the float32 master weights, gradients and Adam moments, a CUDA context;
    rank 0 also what it publishes from (CUDA IPC: the versions it shares; NCCL: two buckets in flight)."""
    n = cfg.cluster.n_trainer_ranks
    out = [
        Holding(rank, 16 * params // n, f"float32 weights, gradients and Adam moments over {n} rank(s)"),
        Holding(rank, CUDA_CONTEXT, "CUDA context"),
    ]
    if rank == "trainer" and n > 1 and cfg.tensor_channel.weights != "nccl":
        out.append(Holding(rank, int(cfg.tensor_channel.bucket_mb * MiB), "one bucket gathered to publish"))
    if rank == "trainer" and cfg.tensor_channel.weights == "cuda_ipc":
        out.append(Holding(rank, (VERSIONS_HELD + 1) * nbytes, f"{VERSIONS_HELD + 1} shared versions (CUDA IPC)"))
    if rank == "trainer" and cfg.tensor_channel.weights == "nccl":
        out.append(Holding(rank, 2 * int(cfg.tensor_channel.bucket_mb * MiB), "two buckets in flight (NCCL)"))
    return out


def server_holding(cfg: ExperimentConfig, who: str) -> Holding:
    if who.startswith("vllm"):
        return Holding(who, 0, "all vLLM uses", cfg.vllm.gpu_memory_utilization)
    what = "weights + KV cache; activations and CUDA graphs in the rest"
    return Holding(who, 0, what, cfg.sglang.mem_fraction_static)


def gpu_holdings(cfg: ExperimentConfig, placement: dict[str, Slot], nbytes: int, params: int) -> dict:
    """(node, physical GPU) -> what each process keeps there, for every GPU the placement uses."""
    out: dict[tuple[int, int], list[Holding]] = {}
    for who, slot in placement.items():
        if not slot.gpus:
            continue
        if who.startswith(("sglang-", "vllm-")):
            held = [server_holding(cfg, who)]
        elif who.startswith("rollout-"):
            held = [Holding(who, h.nbytes, h.what) for h in rollout_gpu_bytes(cfg, placement, nbytes, params)]
        else:
            held = trainer_gpu_bytes(cfg, who, nbytes, params)
        none = Holding(who, 0, "no CUDA allocation: its weights and tensors stay on the host")
        out.setdefault((slot.node, slot.physical[0]), []).extend(held or [none])
    return out


def server_room(h: Holding, gpu: int) -> tuple[int, int, int]:
    """(room for other processes, the server's rest of the GPU, the server's own need in that rest): vLLM needs
    none of its rest; SGLang what it reckons for its activations and CUDA graphs (memory_hook.py)."""
    rest = int((1 - h.fraction) * gpu)
    own = 0
    if h.who.startswith("sglang"):
        own = SGLANG_FLOOR_ABOVE_60GIB if gpu > 60 * GiB else SGLANG_FLOOR_SMALL
    return max(0, rest - own), rest, own


def room_text(h: Holding, gpu: int) -> str:
    room, rest, own = server_room(h, gpu)
    key = "sglang.mem_fraction_static" if h.who.startswith("sglang") else "vllm.gpu_memory_utilization"
    text = f"{key}={h.fraction:g} leaves {gb(rest)} of a {gpu / GiB:.1f} GiB GPU"
    if own:
        text += (
            f", of which SGLang 0.5.23 reserves at least {gb(own)} for its activations and CUDA graphs when it "
            "sizes its own fraction (memory_hook.py)"
        )
    return f"{text}: room for {gb(room)}"


def server_gpu_overflow(cfg: ExperimentConfig, placement: dict[str, Slot], nbytes: int, params: int, gpu: int):
    """(key, value, what) for the first server GPU whose co-located processes need more than its room; None."""
    for (node, g), held in gpu_holdings(cfg, placement, nbytes, params).items():
        servers = [h for h in held if h.fraction]
        others = [h for h in held if not h.fraction and h.nbytes]
        need = sum(h.nbytes for h in others)
        if not servers or not need:
            continue
        if need > server_room(servers[0], gpu)[0]:
            who = sorted({h.who for h in others})
            parts = ", ".join(f"{h.what} {gb(h.nbytes)}" for h in others)
            what = (
                f"{'/'.join(who)} on node {node} GPU {g} beside {servers[0].who} would allocate {gb(need)} there "
                f"({parts}) but {room_text(servers[0], gpu)}"
            )
            key = "tensor_channel.weights" if cfg.tensor_channel.weights == "nccl" else "tensor_channel.trajectories"
            return key, getattr(cfg.tensor_channel, key.split(".")[1]), what
    return None


def gpu_memory(cfg: ExperimentConfig) -> tuple[int, str]:
    """(bytes of one GPU, where the figure comes from): cluster.gpu_memory_gib, else nvidia-smi here, else the
    preset's assumption (then ``source`` is "assumed" and nothing is refused on it)."""
    if cfg.cluster.gpu_memory_gib:
        return int(cfg.cluster.gpu_memory_gib * GiB), "cluster.gpu_memory_gib"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            return int(float(out.stdout.split()[0]) * MiB), "nvidia-smi"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return int(ASSUMED_GPU_GIB * GiB), "assumed"


def account(cfg: ExperimentConfig, placement: dict[str, Slot], params: int, lora_params: int = 0) -> list[str]:
    """The dry run's lines (YAML comments): the weight path per hop, then the memory of every GPU used."""
    nbytes = version_bytes(cfg, params, lora_params)
    gpu, source = gpu_memory(cfg)
    what = "adapter" if lora_params else f"{params / 1e6:.1f}M parameters"
    out = [f"# weight path per update ({what}, {cfg.model.dtype}: {gb(nbytes)} a version; rollout-0 shown):"]
    out += [f"#   {h.line()}" for h in weight_hops(cfg, placement, nbytes)]
    if cfg.cluster.device != "cuda":
        return out
    where = "assumed: set cluster.gpu_memory_gib" if source == "assumed" else f"from {source}"
    out.append(f"# memory per GPU ({gpu / GiB:.1f} GiB a GPU, {where}; estimates):")
    for (node, g), held in sorted(gpu_holdings(cfg, placement, nbytes, params).items()):
        out.append(
            f"#   node {node} GPU {g}: " + " | ".join(_held_text(h, gpu) for h in _by_process(held)) + _left(held, gpu)
        )
    return out


def _by_process(held: list[Holding]) -> list[Holding]:
    """One entry per process: its bytes summed, what they are joined."""
    out: dict[str, Holding] = {}
    for h in held:
        if h.who in out and not h.fraction:
            o = out[h.who]
            out[h.who] = Holding(h.who, o.nbytes + h.nbytes, f"{o.what} + {h.what} {gb(h.nbytes)}")
        else:
            out[h.who] = Holding(h.who, h.nbytes, f"{h.what} {gb(h.nbytes)}" if h.nbytes else h.what, h.fraction)
    return list(out.values())


def _held_text(h: Holding, gpu: int) -> str:
    if h.fraction:
        return f"{h.who} {h.fraction:g} x GPU = {gb(h.fraction * gpu)} ({h.what})"
    return f"{h.who} {gb(h.nbytes)} ({h.what})" if h.nbytes else f"{h.who} 0 B ({h.what})"


def _left(held: list[Holding], gpu: int) -> str:
    servers = [h for h in held if h.fraction]
    used = sum(h.nbytes for h in held) + sum(h.fraction for h in held) * gpu
    if not servers:
        return f" | left {gb(gpu - used)} for activations"
    room, rest, own = server_room(servers[0], gpu)
    return f" | left {gb(rest)}" + (f", SGLang's own {gb(own)} out: room {gb(room)}" if own else "")
