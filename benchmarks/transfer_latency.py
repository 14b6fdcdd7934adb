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
- the bound, measured in the same run, one definition for every row (written in each row as
  ``bound_def``; ``timing.BOUND_DEF``): per sample, the faster of a single-threaded ``copy_`` and a
  libc memmove (``np.copyto``; glibc's large copies skip reading the destination, so it is usually
  the faster one here) of the same bytes between two warm buffers (on GPU: a device-to-device
  ``copy_``); at least 5 samples per row (``bound_gbps_samples``, also with ``--quick``), taken
  between the row's timed transfers (before each, and for weight rows after the last), their median
  the row's ``bound_gbps`` and ``bound_spread`` = (max - min) / median. ``ratio`` = GB/s over it;
  ``ratio_memmove`` over memmove alone, ``copy_gbps`` / ``memmove_gbps`` each alone. (Rows before
  this definition, without ``bound_def``, had one ``copy_`` sampled once per version, and
  ``memcpy_gbps``/``ratio_memcpy`` for memmove.) Weight rows share one bound of ``CPU_MAX_BYTES``
  (the largest payload). The shm path does one copy (into a pooled, pre-faulted slab) and the
  receiver maps the slab as tensors, so the ratio says what the channel costs beyond the one copy
  any hand-off needs.
- gloo's wire (CPU): ``wire_bound``, 256 MiB over one loopback TCP connection; and per pipelined gloo
  weight row a ``gloo_fraction_of_wire`` row: the row's GB/s over loopback TCP carrying the same bytes
  over as many connections as the channel has lanes, sampled between the row's timed versions
  (``benchmarks/common/wire.py``; target >= 0.75), and over memmove.
- weight sync (shm, since the receivers verify while the publisher packs): the receiver's phases are
  wait (for the stamps of buckets not yet written), verify, lock, unflatten.
- weight sync: from ``publish_begin`` on the trainer to ``receive`` returning (verified) on
  the rollout side, for synthetic Qwen2-shaped bf16 state dicts from a tiny model (0.6M params)
  up to 1.5B; gloo/nccl also with ``pipeline=False`` to show the pack/broadcast overlap. Each
  weight row carries the phases of its last sample: the publisher's (``pub_phases``: plan,
  segment, pack_checksum for shm; pack_checksum, send for gloo) and the receiver's
  (``recv_phases``: lock, verify, unflatten for shm; alloc, wire_wait, checksum for gloo).
- weight sync end to end (``weight_sync_e2e``, CPU; ``--no-e2e`` skips it): the same channel into
  an embedded engine (``TorchEngine`` over a Qwen2 model of that shape, with kv heads that divide
  its heads: ``payloads.engine_shape``) holding 4 groups x 2 samples mid-generation, from
  ``publish_begin`` to the engine generating with the new weights: received, copied into its
  parameters (``load_s``) and every running KV cache recomputed (``recompute_s``).
- delta (``weight_sync_delta``, shm/zmq, models up to ``DELTA_MAX_PARAMS``): the same model over a delta
  channel (``tensor_channel.weight_delta``, ``transport/delta.py``), each timed version the one before
  with ``DELTA_FRACTION`` of its elements moved one ulp (``payloads.nudge``) and the peer holding the one
  before: from ``publish_begin`` to the delta applied and checked; ``wire_bytes`` (the compressed delta),
  ``bytes_ratio`` and ``time_ratio`` against the model's full row.
- LoRA (``weight_sync_lora``): a rank-16 adapter on every linear layer of the same model (bf16,
  ``payloads.lora_state_dict``: L r (9 h + 2 kv + 3 i) numbers), through the same channel right after
  the full weights: what a LoRA run publishes instead; ``bytes_ratio`` and ``time_ratio`` against the
  model's full row (pipelined).
- backends (``weight_sync_backend``, CPU; ``--no-e2e`` skips them too): from ``publish_begin`` over shm to an
  inference server generating with the new version, by phase, and the server's own load time:
  ``benchmarks/common/backends.py`` (``--backends``, ``--backend-models``).

p50/p99 are over ``repeats`` samples after one warm-up (with few repeats p99 is ~ the max).
JSON rows: ``metric``, ``value``, ``unit`` always; transfer and weight rows also ``transport``,
``bytes``, ``p50_s``, ``p99_s``, ``gbps``, the bound's fields (``bound_gbps_samples``, ``bound_gbps``,
``bound_spread``, ``ratio`` = gbps / bound_gbps, ``copy_gbps``, ``memmove_gbps``, ``ratio_memmove``,
``bound_def``); ``gloo_fraction_of_wire`` rows: ``wire.fraction_row``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from benchmarks.common.payloads import (
    MODELS,
    boba_batch,
    engine_shape,
    lora_state_dict,
    n_params,
    nbytes,
    nudge,
    pack_batch,
    synthetic_state_dict,
)
from benchmarks.common.channels import (
    CHANNEL_OPS,
    GPU_KINDS,
    endpoints,
    open_pair,
    time_each,
    time_stream,
    time_weights,
    unavailable,
    weight_kwargs,
)
from benchmarks.common import backends as B
from benchmarks.common.peers import Peer
from benchmarks.common.plot import transfer_plot
from benchmarks.common.rows import write_rows
from benchmarks.common.transfer_table import show
from benchmarks.common.timing import BoundSamples, Copier, memcpy_row, memcpy_seconds, stats
from benchmarks.common.wire import WIRE_OPS, Streams, fraction_row, wire_row
from areal_async.transport.collective import WEIGHT_LANES

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CPU_MAX_BYTES = 256 * MiB
ZMQ_CPU_MAX_PARAMS = 6e8  # zmq weight sync holds ~4 copies (state dict, buckets, frames, decoded)
DELTA_KINDS = ("shm", "zmq")  # the pull channels a delta publication runs over (transport/delta.py)
DELTA_MAX_PARAMS = 6e8  # on CPU: delta holds ~6 copies (state dict, 2 + 2 flat buffers, the inner channel's)
DELTA_FRACTION = 0.02  # of the elements moved one ulp between two versions (payloads.nudge)
CPU_TRANSPORTS = ("shm", "zmq", "gloo")
GPU_TRANSPORTS = GPU_KINDS
LORA_RANK = 16  # the adapter rows: rank 16 on every linear layer, bf16 (as the full rows)


# --- configure --------------------------------------------------------------------------------


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
    weight_reps: int = 2
    e2e: bool = True
    backends: list[tuple[str, str]] = field(default_factory=list)  # (backend, model) of the backend rows

    def reps(self, size: int) -> int:
        if self.repeats:
            return self.repeats
        lo, hi = (3, 10) if self.quick else (5, 30)
        return int(min(hi, max(lo, 512 * MiB // max(size, 1))))


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
    p.add_argument("--weight-repeats", type=int, help="weight versions timed per case (default 1 quick, else 2)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end rows (embedded engine, servers)")
    p.add_argument("--backends", help="servers of the backend rows: sglang,vllm (default; --quick: sglang) or none")
    p.add_argument("--backend-models", default="tiny", help="models of the backend rows: tiny (default), 0.13B")
    return p.parse_args(argv)


def build_opts(a: argparse.Namespace) -> Opts:
    notes: list[str] = []
    sizes = payload_sizes(a, notes)
    prompts = a.boba_prompts or (8 if a.quick else 32 if a.device == "cpu" else 512)
    if prompts < 512:
        notes.append(f"boba batch scaled to {prompts} prompts x {a.boba_samples} samples (the recipe: 512 x 16)")
    models = weight_models(a, notes)
    return Opts(
        a.device,
        transports(a, notes),
        sizes,
        a.repeats,
        a.quick,
        (prompts, a.boba_samples, a.boba_max_len),
        models,
        notes,
        a.weight_repeats or (1 if a.quick else 2),
        not a.no_e2e,
        B.cases(a, notes),
    )


def payload_sizes(a: argparse.Namespace, notes: list[str]) -> list[int]:
    cap = a.max_bytes or (GiB if a.device == "cuda" else CPU_MAX_BYTES)
    if a.device == "cpu" and cap < GiB:
        notes.append(f"CPU: payloads capped at {cap >> 20} MiB for memory/time; 1 GiB needs --max-bytes {GiB}")
    step = 16 if a.quick else 4
    sizes = [s for s in (KiB * step**i for i in range(12)) if s <= cap]
    return sorted(set(sizes + [s for s in (256 * MiB, GiB) if s <= cap]))


def weight_models(a: argparse.Namespace, notes: list[str]) -> list[str]:
    max_params = a.weights_max_params or (1.3e8 if a.quick and a.device == "cpu" else 1.6e9)
    models = [m for m in MODELS if n_params(m) <= max_params]
    if "1.5B" not in models:
        notes.append(f"weight sync scaled down: models up to {models[-1]} (1.5B needs --weights-max-params 1.6e9)")
    notes.append(
        "bound = per sample the faster of 1-thread copy_ and memmove between warm buffers, >= 5 samples per row "
        "between its timed transfers, median; weight-sync rows use the copy of the largest payload"
    )
    if a.device == "cpu" and any(n_params(m) > ZMQ_CPU_MAX_PARAMS for m in models):
        notes.append(f"zmq weight sync skipped above {ZMQ_CPU_MAX_PARAMS:.1g} params on CPU (holds ~4 copies in RAM)")
    return models


def transports(a: argparse.Namespace, notes: list[str]) -> list[str]:
    kinds = a.transports.split(",") if a.transports else list(CPU_TRANSPORTS if a.device == "cpu" else GPU_TRANSPORTS)
    for k in list(kinds):
        why = unavailable(k, a.device)
        if why:
            notes.append(f"skipped {k}: {why}")
            kinds.remove(k)
    return kinds


# --- measure (this process: rollout side for trajectories, trainer side for weights) ----------


def run(opts: Opts) -> list[dict]:
    from tqdm import tqdm

    torch.set_num_threads(1)  # the bound and the channels copy on one thread each
    info = {
        "metric": "run_info",
        "value": 0,
        "unit": "",
        "device": opts.device,
        "transports": opts.transports,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "notes": opts.notes,
    }
    rows = [memcpy_row(size, memcpy_seconds(size, opts.device, opts.reps(size)), opts.device) for size in opts.sizes]
    weight_bound = Copier(max(opts.sizes), opts.device)
    cases = len(opts.transports) * (len(opts.sizes) + 1 + len(opts.models))
    ops = {**CHANNEL_OPS, **B.BACKEND_OPS, **WIRE_OPS}
    with Peer(opts.device, ops) as peer, tqdm(total=cases, desc="transfer_latency", unit="case") as bar:
        for kind in opts.transports:
            rows += run_transfers(peer, kind, opts, bar)
            rows += run_weights(peer, kind, opts, weight_bound, bar)
        if "gloo" in opts.transports and opts.device == "cpu":  # gloo's wire here: loopback TCP
            rows.append(wire_row(peer, max(opts.sizes), 3 if opts.quick else 5, weight_bound))
        try:
            rows += B.run_rows(peer, opts.backends, opts.weight_reps, weight_bound, weight_row)
        except Exception as e:  # a backend row that fails loses nothing measured before it; the run still fails
            raise PartialRun([info] + rows) from e
    return [info] + rows


class PartialRun(Exception):
    """A backend row failed after ``rows`` were measured: ``main`` writes them, then fails naming the cause."""

    def __init__(self, rows: list[dict]) -> None:
        super().__init__(f"{len(rows)} rows measured before a backend row failed")
        self.rows = rows


def run_transfers(peer: Peer, kind: str, opts: Opts, bar) -> list[dict]:
    theirs, mine = endpoints(kind)
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


def run_boba(peer: Peer, ch, kind: str, opts: Opts) -> list[dict]:
    seqs = boba_batch(*opts.boba)
    if opts.device == "cuda":
        seqs = [{k: v.to("cuda") for k, v in s.items()} for s in seqs]
    packed = pack_batch(seqs)
    size, bound, reps = nbytes(packed), Copier(nbytes(packed), opts.device), 3 if opts.quick else 5
    per_seq = time_stream(peer, ch, seqs, max(1, reps // 2), bound)
    rows = [
        transfer_row(kind, "boba_packed", size, time_each(peer, ch, packed, reps, bound), opts.device),
        transfer_row(kind, "boba_per_seq", size, per_seq, opts.device),
    ]
    for r in rows:
        r["n_seqs"], r["tokens"] = len(seqs), int(packed["ids_T"].numel())
    return rows


def run_weights(peer: Peer, kind: str, opts: Opts, bound: Copier, bar) -> list[dict]:
    theirs, mine = weight_kwargs(kind)
    ch = open_pair(peer, kind, "weights", {**mine, "bucket_mb": 64.0}, theirs)
    rows, version = [], 0
    try:
        for model in opts.models:
            if kind == "zmq" and opts.device == "cpu" and n_params(model) > ZMQ_CPU_MAX_PARAMS:
                bar.update(1)  # skipped: see the note added in weight_models
                continue
            sd = synthetic_state_dict(*MODELS[model], device=opts.device)
            full: dict = {}
            for pipeline in [True, False] if kind in ("gloo", "nccl") else [True]:
                ch.pipeline = pipeline
                got = run_full(peer, ch, kind, model, sd, pipeline, opts, bound, version)
                version += 10
                rows += got
                full = got[0] if pipeline else full  # the pipelined row: what the LoRA row compares with
            ch.pipeline = True
            rows.append(run_lora(peer, ch, kind, model, full, opts, bound, version))
            version += 10
            if kind in DELTA_KINDS and opts.device == "cpu" and n_params(model) <= DELTA_MAX_PARAMS:
                rows.append(run_delta(peer, kind, model, full, opts, bound, version))
                version += 10
            del sd
            if opts.e2e and opts.device == "cpu":
                rows.append(run_e2e(peer, ch, kind, model, opts, bound, version))
                version += 10
            bar.update(1)
    finally:
        ch.close()
        peer.call("close", what="weights")
    return rows


def run_full(peer: Peer, ch, kind: str, model: str, sd: dict, pipeline: bool, opts: Opts, bound: Copier, version: int):
    """The model's full-weights row; for pipelined gloo on CPU also its ``gloo_fraction_of_wire`` row, the wire
    (``Streams``: the same bytes over the channel's ``WEIGHT_LANES`` connections) sampled between its versions."""
    lanes = len(getattr(getattr(ch, "group", None), "lanes", ())) or WEIGHT_LANES  # the channel's own count
    wire = Streams(peer, nbytes(sd), lanes) if kind == "gloo" and pipeline and opts.device == "cpu" else None
    try:
        between = wire.sample if wire is not None else None
        samples, pub, b, last = time_weights(peer, ch, sd, version, opts.weight_reps, bound, between=between)
    finally:
        if wire is not None:
            wire.close()
    row = weight_row(kind, model, sd, samples, pub, pipeline, b, opts.device, last)
    return [row] + ([fraction_row(row, wire)] if wire is not None else [])


def run_lora(peer: Peer, ch, kind: str, model: str, full: dict, opts: Opts, bound: Copier, version: int) -> dict:
    """A rank-``LORA_RANK`` adapter of the same model through the same channel (what a LoRA run publishes),
    beside ``full`` (that model's full-weights row): bytes and time, and their ratios."""
    sd = lora_state_dict(MODELS[model], rank=LORA_RANK, device=opts.device)
    samples, pub, b, last = time_weights(peer, ch, sd, version, opts.weight_reps, bound)
    row = weight_row(kind, model, sd, samples, pub, True, b, opts.device, last)
    row.update(
        metric="weight_sync_lora",
        rank=LORA_RANK,
        full_bytes=full["bytes"],
        full_p50_s=full["p50_s"],
        bytes_ratio=full["bytes"] / row["bytes"],
        time_ratio=full["p50_s"] / row["p50_s"],
    )
    return row


def run_delta(peer: Peer, kind: str, model: str, full: dict, opts: Opts, bound: Copier, version: int) -> dict:
    """The same model over a delta channel (``tensor_channel.weight_delta``): each timed version is the one
    before with ``DELTA_FRACTION`` of its elements moved one ulp, and the peer holds the one before, so it
    takes the delta; beside ``full`` (the plain channel's row): the bytes on the wire and the time."""
    theirs, mine = weight_kwargs(kind)
    ch = open_pair(peer, kind, "delta", {**mine, "bucket_mb": 64.0, "delta": True}, {**theirs, "delta": True})
    sd = synthetic_state_dict(*MODELS[model], device=opts.device)
    try:  # two untimed versions first (the full one, then a delta): both flat buffers of each side are warm
        time_weights(peer, ch, sd, version, 1, bound, what="delta")
        timed = time_weights(peer, ch, sd, version + 2, opts.weight_reps, bound, what="delta",
                             change=lambda i: nudge(sd, DELTA_FRACTION, seed=i))  # fmt: skip
        wire = ch.sizes["delta"]
    finally:
        ch.close()
        peer.call("close", what="delta")
    samples, pub, b, last = timed
    if last.get("path") != "delta":
        raise RuntimeError(f"delta {kind} {model}: the peer took the {last.get('path')!r} path, not the delta")
    row = weight_row(kind, model, sd, samples, pub, True, b, opts.device, last)
    row.update(
        metric="weight_sync_delta",
        changed_fraction=DELTA_FRACTION,
        wire_bytes=wire,
        full_p50_s=full["p50_s"],
        bytes_ratio=row["bytes"] / wire,
        time_ratio=full["p50_s"] / row["p50_s"],
    )
    return row


def run_e2e(peer: Peer, ch, kind: str, model: str, opts: Opts, bound: Copier, version: int) -> dict:
    """The same channel into the peer's embedded engine: publish -> weights loaded, KV caches recomputed."""
    shape = engine_shape(model)
    if peer.call("engine", shape=list(shape), groups=4, samples=2, prompt_len=64, steps=8)["params"] == 0:
        raise RuntimeError(f"engine of {model}: no parameters")
    sd = synthetic_state_dict(*shape, device=opts.device)
    samples, pub, b, last = time_weights(peer, ch, sd, version, opts.weight_reps, bound, op="weights_e2e")
    row = weight_row(kind, model, sd, samples, pub, True, b, opts.device, last)
    row.update(metric="weight_sync_e2e", load_s=last["load_s"], recompute_s=last["recompute_s"])
    row["receive_end_s"] = last["t_recv"] - (last["t1"] - samples[-1])  # publish_begin -> receive returned
    return row


# --- rows ---------------------------------------------------------------------------------------


def transfer_row(kind: str, payload: str, size: int, timed: tuple[list[float], BoundSamples], device: str) -> dict:
    samples, b = timed
    st = stats(samples)
    gbps = size / st["p50_s"] / 1e9
    return {
        "metric": "transfer_latency",
        "value": st["p50_s"],
        "unit": "s",
        "transport": kind,
        "payload": payload,
        "bytes": size,
        "repeats": len(samples),
        **st,
        "gbps": gbps,
        **b.fields(gbps),
        "device": device,
    }


def weight_row(
    kind: str,
    model: str,
    sd: dict,
    samples: list[float],
    pub: list[float],
    pipeline: bool,
    bound: BoundSamples,
    device: str,
    last: Optional[dict] = None,
) -> dict:
    """``bound``: the row's bound samples; ``last``: the last sample's answer, for its phases (the
    publisher's and the receiver's, seconds)."""
    size, st, last = nbytes(sd), stats(samples), last or {}
    gbps = size / st["p50_s"] / 1e9
    return {
        "metric": "weight_sync",
        "value": st["p50_s"],
        "unit": "s",
        "transport": kind,
        "model": model,
        "params": sum(t.numel() for t in sd.values()),
        "bytes": size,
        "pipeline": pipeline,
        "repeats": len(samples),
        **st,
        "samples_s": [round(x, 5) for x in samples],
        "publish_p50_s": stats(pub)["p50_s"],
        "gbps": gbps,
        **bound.fields(gbps),
        "device": device,
        "pub_phases": last.get("pub_phases", {}),
        "recv_phases": last.get("phases", {}),
        "pub_cpu_s": last.get("pub_cpu_s"),
    }


def main(argv: Optional[list[str]] = None) -> list[dict]:
    a = parse_args(argv)
    try:
        rows, failed = run(build_opts(a)), None
    except PartialRun as e:
        rows, failed = e.rows, e
    show(rows)
    if a.json:
        write_rows(a.json, rows)
    if failed is not None:
        raise SystemExit(f"transfer_latency: {failed} ({failed.__cause__!r}); those rows are written") from failed
    if a.plot:
        transfer_plot(rows, a.plot)
    return rows


if __name__ == "__main__":
    main()
