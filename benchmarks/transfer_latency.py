"""Generation-to-training transfer latency and weight-sync time, per tensor channel.

    python -m benchmarks.transfer_latency [--json PATH] [--quick] [--max-bytes N] [--repeats R]
                                          [--plot PNG] [--device cpu|cuda] [--transports shm,zmq]

What is timed (two processes: this one is the rollout side / trainer publisher, a spawned peer
the trainer side / rollout receiver):

- transfer: from just before ``send`` on the rollout side ("batch finished") to ``recv``
  returning on the trainer side with tensors usable there (on GPU: after a device sync). Both
  timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for all processes of a Linux
  host). One message in flight at a time: the next send waits for the peer's ack, so no
  queueing is measured. Payloads: one float32 tensor per size from 1 KiB to 256 MiB (1 GiB with
  ``--max-bytes 1073741824``; capped on CPU for memory/time, the output says so), and a
  boba-shaped batch (token ids int32, logprobs float32, versions int32 per token; lengths
  lognormal capped at 27K), sent packed (one message) and per sequence (one message each,
  streamed; time from the first send to the last receive).
- the bound, measured in the same run: one single-threaded copy of the same bytes between two
  warm buffers (``dst.copy_(src)``; on GPU a device-to-device copy). The shm path does exactly
  one such copy (into a pooled, pre-faulted slab) and the receiver maps the slab as tensors, so
  the ratio says what the channel costs beyond the one copy any hand-off needs.
- weight sync: from ``publish_begin`` on the trainer to ``receive`` returning (verified) on
  the rollout side, for synthetic Qwen2-shaped bf16 state dicts from a tiny model (0.6M params)
  up to 1.5B; gloo/nccl also with ``pipeline=False`` to show the pack/broadcast overlap.

p50/p99 are over ``repeats`` samples after one warm-up (with few repeats p99 is ~ the max).
JSON rows: ``metric``, ``value``, ``unit`` always; transfer and weight rows also ``transport``,
``bytes``, ``p50_s``, ``p99_s``, ``gbps``, ``bound_gbps``, ``ratio`` (= gbps / bound_gbps).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import numpy as np
import torch

from protocols.sockets import free_tcp_port

from benchmarks.common import write_rows

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CPU_MAX_BYTES = 256 * MiB
ZMQ_CPU_MAX_PARAMS = 6e8  # zmq weight sync holds ~4 copies (state dict, buckets, frames, decoded)
CPU_TRANSPORTS = ("shm", "zmq", "gloo")
GPU_TRANSPORTS = ("cuda_ipc", "nccl")
MODELS = {  # name: (hidden, intermediate, layers, vocab, kv_heads, tied embeddings); Qwen2 shapes
    "tiny-0.6M": (128, 352, 2, 512, 2, False),
    "0.13B": (768, 2048, 12, 32000, 4, False),
    "0.5B": (896, 4864, 24, 151936, 2, True),  # Qwen2-0.5B: 494M
    "1.5B": (1536, 8960, 28, 151936, 2, True),  # Qwen2-1.5B / DeepSeek-R1-Distill-Qwen-1.5B: 1.54B
}


# --------------------------------------------------------------------------------------------
# payloads
# --------------------------------------------------------------------------------------------


def synthetic_state_dict(hidden: int, inter: int, layers: int, vocab: int, kv_heads: int, tied: bool,
                         dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A Qwen2-shaped state dict filled with cheap distinct constants (contents do not matter here)."""
    head = hidden // max(1, hidden // 128) if hidden >= 128 else hidden
    kv = kv_heads * head
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                       p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (hidden, hidden), p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {n: torch.empty(s, dtype=dtype, device=device).fill_((i % 97) / 97) for i, (n, s) in enumerate(shapes.items())}


def n_params(model: str) -> int:
    return sum(t.numel() for t in synthetic_state_dict(*MODELS[model], device="meta").values())


def boba_batch(n_prompts: int, n_samples: int, max_len: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One dict per sequence: ids_T int32, logp_T float32, ver_T int32; lengths lognormal, capped."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(mean=np.log(4000), sigma=1.0, size=n_prompts * n_samples), max_len).astype(int)
    g = torch.Generator().manual_seed(seed)
    return [{"ids_T": torch.randint(0, 151936, (n,), dtype=torch.int32, generator=g),
             "logp_T": -torch.rand(n, generator=g) * 5, "ver_T": torch.full((n,), 7, dtype=torch.int32)}
            for n in lens.clip(1)]


def pack_batch(seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lens = torch.tensor([len(s["ids_T"]) for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return {"ids_T": torch.cat([s["ids_T"] for s in seqs]), "logp_T": torch.cat([s["logp_T"] for s in seqs]),
            "ver_T": torch.cat([s["ver_T"] for s in seqs]), "cu_seqlens": cu}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --------------------------------------------------------------------------------------------
# the peer process (trainer side for trajectories, rollout side for weights)
# --------------------------------------------------------------------------------------------


def _peer_main(conn, device: str) -> None:
    """Serve commands from the parent over a pipe (msgpack bytes, never pickle)."""
    torch.set_num_threads(1)
    state: dict[str, Any] = {"conn": conn, "device": device}
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
        try:
            reply = _PEER_OPS[cmd["op"]](state, cmd)
        except Exception as e:  # reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        _reply(state, reply)
        if cmd["op"] == "exit":
            return


def _reply(state: dict, reply: dict) -> None:
    state["conn"].send_bytes(msgpack.packb(reply, use_bin_type=True))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peer_open(state: dict, cmd: dict) -> dict:
    from areal_async.transport import make_tensor_channel, make_weight_channel

    if cmd["kwargs"].get("device") is not None:
        torch.cuda.set_device(cmd["kwargs"]["device"])
    make = make_tensor_channel if cmd["what"] == "traj" else make_weight_channel
    state[cmd["what"]] = make(cmd["kind"], role="receiver", **cmd["kwargs"])
    return {"ok": True}


def _peer_expect(state: dict, cmd: dict) -> dict:
    """Receive ``n`` messages; ack each one's latency ('each') or first-send-to-last-receive ('last')."""
    ch, first_t0, t1 = state["traj"], None, 0.0
    for _ in range(cmd["n"]):
        key, meta, tensors = ch.recv(timeout_s=300)
        _sync(state["device"])
        t1 = time.perf_counter()
        first_t0 = meta["t0"] if first_t0 is None else first_t0
        del tensors  # frees the shm slab for the next message
        if cmd["ack"] == "each":
            _reply(state, {"lat": t1 - meta["t0"]})
    return {"lat": t1 - first_t0}


def _peer_weights(state: dict, cmd: dict) -> dict:
    sd = state["weights"].receive(cmd["manifest"])
    _sync(state["device"])
    return {"t1": time.perf_counter(), "params": sum(t.numel() for t in sd.values())}


def _peer_close(state: dict, cmd: dict) -> dict:
    ch = state.pop(cmd["what"], None)
    if ch is not None:
        ch.close()
    return {"ok": True}


_PEER_OPS = {"open": _peer_open, "expect": _peer_expect, "weights": _peer_weights, "close": _peer_close,
             "exit": lambda state, cmd: {"ok": True}}


class Peer:
    def __init__(self, device: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, device), daemon=True)
        self.proc.start()

    def ask(self, op: str, **kw) -> None:
        self.conn.send_bytes(msgpack.packb({"op": op, **kw}, use_bin_type=True))

    def answer(self, timeout_s: float = 600) -> dict:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"benchmark peer (pid {self.proc.pid}) did not answer within {timeout_s}s")
        reply = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        if "error" in reply:
            raise RuntimeError(f"benchmark peer failed: {reply['error']}")
        return reply

    def call(self, op: str, **kw) -> dict:
        self.ask(op, **kw)
        return self.answer()

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("exit")
        self.proc.join(timeout=10)


# --------------------------------------------------------------------------------------------
# the measurements (this process: rollout side for trajectories, trainer side for weights)
# --------------------------------------------------------------------------------------------


@dataclass
class Opts:
    device: str
    transports: list[str]
    sizes: list[int]
    repeats: Optional[int]
    quick: bool
    boba: tuple[int, int, int]  # prompts, samples per prompt, max length
    models: list[str]
    notes: list[str]

    def reps(self, size: int) -> int:
        if self.repeats:
            return self.repeats
        lo, hi = (3, 10) if self.quick else (5, 30)
        return int(min(hi, max(lo, 512 * MiB // max(size, 1))))


def stats(samples: list[float]) -> dict:
    return {"p50_s": float(np.percentile(samples, 50)), "p99_s": float(np.percentile(samples, 99))}


class Copier:
    """The bound: one single-threaded copy of ``size`` bytes between two warm buffers.

    Sampled right before every transfer sample, so load from other processes on a shared machine
    hits the bound and the channel alike and their ratio stays meaningful."""

    def __init__(self, size: int, device: str):
        self.size, self.device = size, device
        self.src = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device).fill_(1.0)
        self.dst = torch.zeros_like(self.src)
        self.dst.copy_(self.src)

    def sample(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        _sync(self.device)
        return time.perf_counter() - t0

    def gbps(self, samples: list[float]) -> float:
        return self.size / stats(samples)["p50_s"] / 1e9


def memcpy_seconds(size: int, device: str, repeats: int) -> list[float]:
    c = Copier(size, device)
    return [c.sample() for _ in range(repeats)]


def endpoints(kind: str, n_gpus: int) -> tuple[dict, dict]:
    """(peer kwargs, my kwargs) for a trajectory channel: the peer receives (trainer, rank 0)."""
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    if kind in ("shm", "zmq"):
        return {"endpoint": ep}, {"endpoint": ep}
    if kind == "cuda_ipc":
        return {"endpoint": ep, "device": 0}, {"endpoint": ep, "device": 0}
    group = {"world_size": 2, "store": f"127.0.0.1:{free_tcp_port()}", "endpoint": ep}
    dev = ({"device": 0}, {"device": 1}) if kind == "nccl" else ({}, {})
    return {**group, "rank": 0, **dev[0]}, {**group, "rank": 1, **dev[1]}


def weight_kwargs(kind: str) -> tuple[dict, dict]:
    """(peer kwargs, my kwargs) for a weight channel: this process publishes (rank 0)."""
    if kind in ("shm", "zmq"):
        return {}, {}
    if kind == "cuda_ipc":
        return {"device": 0}, {"device": 0}
    group = {"world_size": 2, "store": f"127.0.0.1:{free_tcp_port()}"}
    dev = ({"device": 1}, {"device": 0}) if kind == "nccl" else ({}, {})
    return {**group, "rank": 1, **dev[0]}, {**group, "rank": 0, **dev[1]}


def open_pair(peer: "Peer", kind: str, what: str, mine: dict, theirs: dict):
    """Build both ends concurrently (collective channels rendezvous in their constructors)."""
    from areal_async.transport import make_tensor_channel, make_weight_channel

    peer.ask("open", what=what, kind=kind, kwargs=theirs)
    if what == "traj":
        ch = make_tensor_channel(kind, role="sender", **mine)
    else:
        ch = make_weight_channel(kind, role="publisher", **mine)
    peer.answer()
    return ch


def time_each(peer: "Peer", ch, payload: dict, repeats: int, bound: Copier) -> tuple[list[float], list[float]]:
    """Latency of ``repeats`` messages, one in flight at a time, after one warm-up; bound samples."""
    peer.ask("expect", n=repeats + 1, ack="each")
    out, ref = [], []
    for i in range(repeats + 1):
        ref.append(bound.sample())
        t0 = time.perf_counter()
        ch.send(f"m{i}", payload, {"t0": t0})
        lat = peer.answer()["lat"]
        if i:
            out.append(lat)
    peer.answer()
    return out, ref[1:]


def time_stream(peer: "Peer", ch, seqs: list[dict], repeats: int, bound: Copier) -> tuple[list[float], list[float]]:
    """First send to last receive for the sequences sent back to back; bound samples."""
    out, ref = [], []
    for i in range(repeats + 1):
        ref.append(bound.sample())
        peer.ask("expect", n=len(seqs), ack="last")
        for j, s in enumerate(seqs):
            ch.send(f"s{i}/{j}", s, {"t0": time.perf_counter()})
        lat = peer.answer()["lat"]
        if i:
            out.append(lat)
    return out, ref[1:]


def transfer_row(kind: str, payload: str, size: int, timed: tuple[list[float], list[float]], device: str) -> dict:
    samples, ref = timed
    bound_gbps = size / stats(ref)["p50_s"] / 1e9
    st = stats(samples)
    gbps = size / st["p50_s"] / 1e9
    return {"metric": "transfer_latency", "value": st["p50_s"], "unit": "s", "transport": kind, "payload": payload,
            "bytes": size, "repeats": len(samples), **st, "gbps": gbps, "bound_gbps": bound_gbps,
            "ratio": gbps / bound_gbps, "device": device}


def run_transfers(peer: "Peer", kind: str, opts: Opts, bar) -> list[dict]:
    theirs, mine = endpoints(kind, torch.cuda.device_count() if opts.device == "cuda" else 0)
    ch = open_pair(peer, kind, "traj", mine, theirs)
    rows = []
    try:
        for size in opts.sizes:
            x = torch.empty(size // 4, dtype=torch.float32, device=opts.device).fill_(1.0)
            timed = time_each(peer, ch, {"x": x}, opts.reps(size), Copier(size, opts.device))
            rows.append(transfer_row(kind, "bytes", size, timed, opts.device))
            bar.update(1)
        rows += run_boba(peer, ch, kind, opts)
        bar.update(1)
    finally:
        ch.close()
        peer.call("close", what="traj")
    return rows


def run_boba(peer: "Peer", ch, kind: str, opts: Opts) -> list[dict]:
    seqs = boba_batch(*opts.boba)
    if opts.device == "cuda":
        seqs = [{k: v.to("cuda") for k, v in s.items()} for s in seqs]
    packed = pack_batch(seqs)
    size = nbytes(packed)
    bound = Copier(size, opts.device)
    reps = 3 if opts.quick else 5
    rows = [transfer_row(kind, "boba_packed", size, time_each(peer, ch, packed, reps, bound), opts.device),
            transfer_row(kind, "boba_per_seq", size, time_stream(peer, ch, seqs, max(1, reps // 2), bound), opts.device)]
    for r in rows:
        r["n_seqs"], r["tokens"] = len(seqs), int(packed["ids_T"].numel())
    return rows


def run_weights(peer: "Peer", kind: str, opts: Opts, bound: Copier, bar) -> list[dict]:
    theirs, mine = weight_kwargs(kind)
    ch = open_pair(peer, kind, "weights", {**mine, "bucket_mb": 64.0}, theirs)
    rows, version = [], 0
    try:
        for model in opts.models:
            if kind == "zmq" and opts.device == "cpu" and n_params(model) > ZMQ_CPU_MAX_PARAMS:
                bar.update(1)  # skipped: see the note added in build_opts
                continue
            sd = synthetic_state_dict(*MODELS[model], device=opts.device)
            for pipeline in ([True, False] if kind in ("gloo", "nccl") else [True]):
                ch.pipeline = pipeline
                samples, pub, ref = time_weights(peer, ch, sd, version, 1 if opts.quick else 2, bound)
                version += 10
                rows.append(weight_row(kind, model, sd, samples, pub, pipeline, bound.gbps(ref), opts.device))
            del sd
            bar.update(1)
    finally:
        ch.close()
        peer.call("close", what="weights")
    return rows


def time_weights(peer: "Peer", ch, sd: dict, version: int, repeats: int, bound: Copier):
    """(latencies, publisher-side times, bound samples) of ``repeats`` versions after a warm-up."""
    lat, pub, ref = [], [], []
    for i in range(repeats + 1):
        ref.append(bound.sample())
        _sync(str(next(iter(sd.values())).device))
        t0 = time.perf_counter()
        manifest = ch.publish_begin(version + i, sd)
        peer.ask("weights", manifest=manifest)  # the control plane's WeightsPublished
        ch.publish_end()
        t_pub = time.perf_counter() - t0
        t1 = peer.answer()["t1"]
        ch.release(version + i)
        if i:
            lat.append(t1 - t0)
            pub.append(t_pub)
    return lat, pub, ref[1:]


def weight_row(kind: str, model: str, sd: dict, samples: list[float], pub: list[float], pipeline: bool,
               bound_gbps: float, device: str) -> dict:
    size, st = nbytes(sd), stats(samples)
    gbps = size / st["p50_s"] / 1e9
    return {"metric": "weight_sync", "value": st["p50_s"], "unit": "s", "transport": kind, "model": model,
            "params": sum(t.numel() for t in sd.values()), "bytes": size, "pipeline": pipeline,
            "repeats": len(samples), **st, "publish_p50_s": stats(pub)["p50_s"], "gbps": gbps,
            "bound_gbps": bound_gbps, "ratio": gbps / bound_gbps, "device": device}


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def available(kind: str, device: str) -> Optional[str]:
    """None when ``kind`` can run here, else why not."""
    if kind in GPU_TRANSPORTS and device != "cuda":
        return f"{kind} needs --device cuda"
    if kind == "nccl":
        try:
            from areal_async.transport.nccl import require_nccl

            require_nccl()
        except RuntimeError as e:
            return str(e)
        if torch.cuda.device_count() < 2:
            return "nccl needs 2 GPUs (NCCL refuses two ranks on one device)"
    if kind == "shm" and not os.path.isdir("/dev/shm"):
        return "shm needs /dev/shm"
    return None


def build_opts(a: argparse.Namespace) -> Opts:
    notes = []
    cap = a.max_bytes or (GiB if a.device == "cuda" else CPU_MAX_BYTES)
    if a.device == "cpu" and cap < GiB:
        notes.append(f"CPU: payloads capped at {cap >> 20} MiB for memory/time; 1 GiB needs --max-bytes {GiB}")
    step = 16 if a.quick else 4
    sizes = [s for s in (KiB * step**i for i in range(12)) if s <= cap]
    sizes = sorted(set(sizes + [s for s in (256 * MiB, GiB) if s <= cap]))
    prompts = a.boba_prompts or (8 if a.quick else 32 if a.device == "cpu" else 512)
    if prompts < 512:
        notes.append(f"boba batch scaled to {prompts} prompts x {a.boba_samples} samples (the recipe: 512 x 16)")
    max_params = a.weights_max_params or (1.3e8 if a.quick and a.device == "cpu" else 1.6e9)
    models = [m for m in MODELS if n_params(m) <= max_params]
    if "1.5B" not in models:
        notes.append(f"weight sync scaled down: models up to {models[-1]} (1.5B needs --weights-max-params 1.6e9)")
    notes.append("bound = 1-thread copy between warm buffers, sampled before every transfer sample; "
                 "weight-sync rows use the copy of the largest payload")
    if a.device == "cpu" and any(n_params(m) > ZMQ_CPU_MAX_PARAMS for m in models):
        notes.append(f"zmq weight sync skipped above {ZMQ_CPU_MAX_PARAMS:.1g} params on CPU (holds ~4 copies in RAM)")
    transports = a.transports.split(",") if a.transports else list(CPU_TRANSPORTS if a.device == "cpu" else GPU_TRANSPORTS)
    for k in list(transports):
        why = available(k, a.device)
        if why:
            notes.append(f"skipped {k}: {why}")
            transports.remove(k)
    return Opts(a.device, transports, sizes, a.repeats, a.quick, (prompts, a.boba_samples, a.boba_max_len), models, notes)


def measure_bounds(opts: Opts) -> list[dict]:
    """The bound alone, per size, before any channel runs (transfer rows carry their own)."""
    rows = []
    for size in opts.sizes:
        st = stats(memcpy_seconds(size, opts.device, opts.reps(size)))
        rows.append({"metric": "memcpy_bound", "value": size / st["p50_s"] / 1e9, "unit": "GB/s", "bytes": size, **st,
                     "device": opts.device, "how": "dst.copy_(src), warm buffers, 1 thread" if opts.device == "cpu"
                     else "device-to-device copy_"})
    return rows


def run(opts: Opts) -> list[dict]:
    from tqdm import tqdm

    torch.set_num_threads(1)  # the bound and the channels copy on one thread each
    info = {"metric": "run_info", "value": 0, "unit": "", "device": opts.device, "transports": opts.transports,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "notes": opts.notes}
    rows = measure_bounds(opts)
    total = len(opts.transports) * (len(opts.sizes) + 1 + len(opts.models))
    peer = Peer(opts.device)
    weight_bound = Copier(max(opts.sizes), opts.device)
    try:
        with tqdm(total=total, desc="transfer_latency", unit="case") as bar:
            for kind in opts.transports:
                rows += run_transfers(peer, kind, opts, bar)
                rows += run_weights(peer, kind, opts, weight_bound, bar)
    finally:
        peer.close()
    return [info] + rows


def human(n: int) -> str:
    for unit, k in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{n} B"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'transport':<9} {'payload':<13} {'size':>10} {'p50 ms':>10} {'p99 ms':>10} {'GB/s':>8} {'bound':>8} {'ratio':>6}")
    for r in rows:
        if r["metric"] in ("transfer_latency", "weight_sync"):
            what = r.get("payload") or f"w:{r['model']}" + ("" if r.get("pipeline", True) else " serial")
            print(f"{r['transport']:<9} {what:<13} {human(r['bytes']):>10} {r['p50_s'] * 1e3:>10.3f} "
                  f"{r['p99_s'] * 1e3:>10.3f} {r['gbps']:>8.3f} {r['bound_gbps']:>8.3f} {r['ratio']:>6.2f}")
    for note in rows[0].get("notes", []):
        print("note:", note)


def plot_file(json_path: str, png_path: str) -> None:
    with open(json_path) as f:
        plot(json.load(f), png_path)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    per_size: dict[int, list[float]] = {}  # the bound as sampled next to the transfers, all channels
    for r in rows:
        if r["metric"] == "transfer_latency" and r["payload"] == "bytes":
            per_size.setdefault(r["bytes"], []).append(r["bound_gbps"])
    sizes = sorted(per_size)
    ax1.plot(sizes, [float(np.median(per_size[n])) for n in sizes], "k--", label="memcpy bound")
    for kind in sorted({r["transport"] for r in rows if r["metric"] == "transfer_latency"}):
        pts = [r for r in rows if r["metric"] == "transfer_latency" and r["transport"] == kind and r["payload"] == "bytes"]
        ax1.plot([r["bytes"] for r in pts], [r["gbps"] for r in pts], "o-", label=kind)
        w = [r for r in rows if r["metric"] == "weight_sync" and r["transport"] == kind and r["pipeline"]]
        ax2.plot([r["params"] for r in w], [r["p50_s"] for r in w], "o-", label=kind)
    ax1.set(xscale="log", yscale="log", xlabel="payload bytes", ylabel="GB/s (p50)", title="rollout -> trainer transfer")
    ax2.set(xscale="log", yscale="log", xlabel="parameters (bf16)", ylabel="seconds (p50)", title="weight sync")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--quick", action="store_true", help="fewer sizes, repeats and models")
    p.add_argument("--max-bytes", type=int, help="largest payload (default 256 MiB on CPU, 1 GiB on GPU)")
    p.add_argument("--repeats", type=int, help="samples per case (default: by size)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--transports", help="comma list (default: shm,zmq,gloo on CPU; cuda_ipc,nccl on GPU)")
    p.add_argument("--boba-prompts", type=int, help="prompts in the boba-shaped batch (recipe: 512)")
    p.add_argument("--boba-samples", type=int, default=16, help="samples per prompt")
    p.add_argument("--boba-max-len", type=int, default=27000, help="cap of the lognormal sequence lengths")
    p.add_argument("--weights-max-params", type=float, help="largest synthetic model for weight sync")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    a = parse_args(argv)
    rows = run(build_opts(a))
    print_table(rows)
    if a.json:
        write_rows(a.json, rows)
    if a.plot:
        plot(rows, a.plot)
    return rows


if __name__ == "__main__":
    main()
