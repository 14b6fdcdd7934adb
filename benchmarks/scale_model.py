"""Alpha-beta model of the generation->training transfer and of the weight broadcast, 8..1024 GPUs.

    python -m benchmarks.scale_model [--from transfer_latency.json] [--json PATH] [--train-frac 0.25]
                                     [--scheduler-from data_path.json]

A message of n bytes over one link costs ``alpha + n / beta``. Two sources of (alpha, beta):

- fitted: per transport from ``benchmarks.transfer_latency`` rows (``--from``), by least squares
  on the relative error (so the small payloads pin alpha and the large ones beta);
- documented link figures for H100/H200 clusters (defaults below, all overridable): NVLink 4,
  900 GB/s per GPU counted both directions, so 450 GB/s each way; InfiniBand NDR 400 Gb/s per
  NIC (50 GB/s), 8 NICs per node of 8 GPUs; alpha ~20 us per NCCL operation across nodes and
  ~5 us inside a node (NCCL's small-message latency, not the wire's ~1-2 us).

Generation -> training (the boba batch: 512 prompts x 16 samples, sequence lengths lognormal with
median 4000 tokens, sigma 1, capped at 27K - the shape ``transfer_latency`` uses - and 12 bytes
per token: int32 id + float32 logprob + int32 version). With N GPUs, ``train_frac`` of them
train; every trajectory is its own message; senders work in parallel and each trainer receives
its share through its own NIC: ``T = (msgs / trainers) * alpha + (bytes / trainers) / beta``
("spread"); "one_rank" funnels the whole batch into one trainer rank (trainers = 1).

Weight broadcast of P bf16 parameters (S = 2P bytes) from the trainer to the G generation GPUs,
across nodes on IB (the 8 NICs of a node carry 1/8 of S each, as NCCL's parallel rings do) and
inside a node on NVLink:
- p2p: the source sends a full copy to each node in turn: ``nodes * (alpha + S / B_node)``;
- tree: binomial tree over nodes, whole message per hop: ``ceil(log2(nodes)) * (alpha + S / B_node)``;
- ring: pipelined chain over nodes in k chunks, k chosen optimally: ``S/B_node + (nodes - 1 + k - 1) *
  alpha + (nodes - 1) * S / (k B_node)`` ~ ``S/B_node + (nodes-1) alpha + 2 sqrt((nodes-1) alpha S/B_node)``;
each followed (multi-node) by an NVLink allgather of the 8 shards inside every node,
``7/8 * S / B_nvlink + 7 * alpha_nvl``. A LoRA run publishes its adapter alone: ``7B-lora-r16`` is a
rank-16 adapter on every linear layer of Qwen2-7B, P = L r (9 h + 2 kv + 3 i) = 40.4M parameters
(``lora_numel``), broadcast by the same formulas with S = 2P = 80.7 MB instead of 15.2 GB.
Not modelled: congestion, stragglers, the time to gather FSDP shards on the trainer.

Weight update over NCCL, end to end (``predict_weight_update_s``, 1.5B / 7B / 32B, ring): the
broadcast above plus what the channel and the engine add, taken from the CPU measurements of
``benchmarks.transfer_latency`` as multiples of one copy of the same bytes (``COPIES``: pack +
checksum on the trainer, verify on the receiver, the engine's copy into its parameters; from
``--from`` rows when they carry them) at an assumed device copy rate (``--hbm-copy-gbs``). With
buckets pipelined (pack of bucket k+1 during the broadcast of bucket k), only the first bucket's pack
and the last one's verify are exposed; the engine's load is a copy of the whole model. A MODEL, not a
GPU measurement: nothing here has run on a GPU (the CPU multiples stand in for the device's).

The control plane at 1000 and 10,000 GPUs (``--scheduler-from``, ``predict_scheduler_core_frac``): the
fleet's messages a second to the scheduler over the real service's measured messages per CPU second
(``benchmarks.data_path``'s ``scheduler_service_messages_per_s``), as ``benchmarks.common.control_scale`` says.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.common.control_scale import control_rows, control_rows_by_kind
from benchmarks.common.rows import write_rows

GB = 1e9
BYTES_PER_TOKEN = 12
QWEN2_7B = dict(hidden=3584, inter=18944, layers=28, kv=4 * 128)  # Qwen2-7B's config.json (4 KV heads of 128)


def lora_numel(hidden: int, inter: int, layers: int, kv: int, rank: int) -> int:
    """Numbers of a rank-r LoRA adapter on q, k, v, o, gate, up, down (kv = key/value heads x head dim):
    r (in + out) per adapted layer, summed: L r (9 h + 2 kv + 3 i)  [q h+h, k h+kv, v h+kv, o h+h,
    gate h+i, up h+i, down i+h]. Qwen2-7B at r = 16: 28 * 16 * 90,112 = 40,370,176 (0.53 % of 7.6e9)."""
    return layers * rank * (9 * hidden + 2 * kv + 3 * inter)


# parameters published per version (bf16): full models, and a LoRA run's adapter alone
MODELS = {"1.5B": 1.54e9, "7B": 7.6e9, "32B": 32.8e9, "7B-lora-r16": float(lora_numel(**QWEN2_7B, rank=16))}
GPUS = [8 * 2**i for i in range(8)]  # 8 .. 1024
CLAIM_S = 3.0
# an update's non-wire work in copies of its bytes, measured on CPU by transfer_latency (0.13B, shm, load 2-4,
# s35: pack + checksum 32.3 ms, verify 9.3 ms, engine load 22.8 ms of 242 MiB, a 247 MiB copy ~20 ms)
COPIES = {"pack": 1.6, "verify": 0.45, "load": 0.9}
UPDATE_MODELS = ("1.5B", "7B", "32B")


# --- configure --------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", help="transfer_latency JSON to fit alpha/beta from")
    p.add_argument("--json", help="write rows here")
    p.add_argument("--train-frac", type=float, default=0.25, help="fraction of GPUs that train")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=8)
    p.add_argument("--ib-gbit", type=float, default=400.0, help="Gb/s per InfiniBand NIC (NDR)")
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU per direction (900 both ways)")
    p.add_argument("--alpha-net-us", type=float, default=20.0, help="per-operation latency across nodes")
    p.add_argument("--alpha-nvl-us", type=float, default=5.0, help="per-operation latency inside a node")
    p.add_argument(
        "--hbm-copy-gbs",
        type=float,
        default=2000.0,
        help="device-to-device copy rate, GB/s (H200: 4.8 TB/s HBM3e read+write -> <= 2.4 TB/s copied)",
    )
    p.add_argument("--bucket-mb", type=float, default=64.0, help="weight-sync bucket (tensor_channel.bucket_mb)")
    p.add_argument("--boba-prompts", type=int, default=512)
    p.add_argument("--boba-samples", type=int, default=16)
    p.add_argument("--scheduler-from", help="data_path JSON (or .jsonl): the control plane's share of a core at scale")
    return p.parse_args(argv)


# --- model (the measure step: fitted or documented links -> predicted seconds) ----------------


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of t = alpha + n / beta on relative error; (alpha_s, beta_bytes_per_s)."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    a = np.stack([1 / t, n / t], axis=1)  # rows scaled by 1/t: minimizes sum(((alpha + b n) - t) / t)^2
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), 1 / max(float(inv_beta), 1e-30)


def fits_from(rows: list[dict]) -> dict[str, tuple[float, float]]:
    by_kind: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("metric") == "transfer_latency" and r.get("payload") == "bytes":
            by_kind.setdefault(f"{r['transport']}@{r.get('device', 'cpu')}", []).append((r["bytes"], r["p50_s"]))
    return {k: fit_alpha_beta(v) for k, v in by_kind.items() if len(v) >= 2}


def boba_bytes(
    n_prompts: int = 512, n_samples: int = 16, median: float = 4000, sigma: float = 1.0, cap: int = 27000, seed: int = 0
) -> tuple[int, int]:
    """(bytes, sequences) of the boba batch, lengths drawn as in ``benchmarks.common.payloads.boba_batch``."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(np.log(median), sigma, n_prompts * n_samples), cap).astype(int).clip(1)
    return int(lens.sum()) * BYTES_PER_TOKEN, len(lens)


def copies_from(rows: list[dict]) -> dict[str, float]:
    """``COPIES`` from transfer_latency rows: the largest shm model's phases over the time of one copy
    of its bytes at the row's bound (``load`` from the largest shm end-to-end row); ``COPIES``' value
    for what the rows do not carry."""
    out = dict(COPIES)
    full = [r for r in rows if r.get("metric") == "weight_sync" and r.get("transport") == "shm" and r.get("pub_phases")]
    if full:
        r = max(full, key=lambda r: r["bytes"])
        copy_s = r["bytes"] / (r["bound_gbps"] * GB)
        out["pack"] = r["pub_phases"].get("pack_checksum_s", out["pack"] * copy_s) / copy_s
        out["verify"] = r["recv_phases"].get("verify_s", out["verify"] * copy_s) / copy_s
    e2e = [r for r in rows if r.get("metric") == "weight_sync_e2e" and r.get("transport") == "shm"]
    if e2e:
        r = max(e2e, key=lambda r: r["bytes"])
        out["load"] = r["load_s"] / (r["bytes"] / (r["bound_gbps"] * GB))
    return out


class Cluster:
    def __init__(self, a: argparse.Namespace):
        self.gpn = a.gpus_per_node
        self.nic_bps = a.ib_gbit / 8 * GB
        self.node_bps = self.nic_bps * a.nics_per_node
        self.nvl_bps = a.nvlink_gbs * GB
        self.alpha_net = a.alpha_net_us * 1e-6
        self.alpha_nvl = a.alpha_nvl_us * 1e-6
        self.train_frac = a.train_frac
        self.hbm_bps = a.hbm_copy_gbs * GB
        self.bucket = a.bucket_mb * 2**20

    def link(self, gpus: int) -> tuple[float, float]:
        """(alpha, beta) of one GPU's link: NVLink inside one node, its NIC beyond."""
        return (self.alpha_nvl, self.nvl_bps) if gpus <= self.gpn else (self.alpha_net, self.nic_bps)

    def split(self, gpus: int) -> tuple[int, int]:
        train = max(1, round(gpus * self.train_frac))
        return train, gpus - train


def transfer_terms(total_bytes: int, msgs: int, trainers: int, alpha: float, beta: float) -> tuple[float, float]:
    """(latency term, bandwidth term) of the gen->train transfer, trainers receiving in parallel."""
    return math.ceil(msgs / trainers) * alpha, total_bytes / trainers / beta


def broadcast_terms(algo: str, size: float, nodes: int, alpha: float, node_bps: float) -> tuple[float, float]:
    """(latency term, bandwidth term) of broadcasting ``size`` bytes to ``nodes`` nodes."""
    if nodes <= 1:
        return 0.0, 0.0
    if algo == "p2p":
        return nodes * alpha, nodes * size / node_bps
    if algo == "tree":
        hops = math.ceil(math.log2(nodes + 1))
        return hops * alpha, hops * size / node_bps
    k = max(1, round(math.sqrt((nodes - 1) * size / node_bps / alpha)))  # optimal chunk count
    return (nodes - 1 + k - 1) * alpha, size / node_bps + (nodes - 1) * size / (k * node_bps)


def weight_broadcast(c: Cluster, algo: str, params: float, gpus: int) -> tuple[float, float]:
    """(latency, bandwidth) seconds to get 2*params bytes onto every generation GPU."""
    size = 2 * params
    _, gen = c.split(gpus)
    if gpus <= c.gpn:  # one node: NVLink ring among the GPUs
        lat, bw = broadcast_terms(algo, size, gen + 1, c.alpha_nvl, c.nvl_bps)
        return lat, bw
    nodes = math.ceil(gen / c.gpn)
    lat, bw = broadcast_terms(algo, size, nodes + 1, c.alpha_net, c.node_bps)  # +1: the trainer's node
    return lat + (c.gpn - 1) * c.alpha_nvl, bw + (c.gpn - 1) / c.gpn * size / c.nvl_bps


def weight_update(c: Cluster, params: float, gpus: int, copies: dict[str, float]) -> dict:
    """The ring broadcast of 2 * params bytes plus the exposed channel and engine work (``COPIES`` at
    the device copy rate): the first bucket's pack, the last one's verify, the whole model's load."""
    size = 2 * params
    lat, bw = weight_broadcast(c, "ring", params, gpus)
    bucket = min(c.bucket, size)
    exposed = (copies["pack"] * bucket + copies["verify"] * bucket) / c.hbm_bps
    load = copies["load"] * size / c.hbm_bps
    return {"broadcast_s": lat + bw, "exposed_s": exposed, "load_s": load, "value": lat + bw + exposed + load}


def update_rows(c: Cluster, copies: dict[str, float]) -> list[dict]:
    basis = (
        "model: alpha-beta ring broadcast + CPU-measured copy multiples at an assumed device copy rate; "
        "not a GPU measurement"
    )
    return [
        {
            "metric": "predict_weight_update_s",
            "unit": "s",
            "gpus": gpus,
            "model": m,
            "algo": "ring",
            **weight_update(c, MODELS[m], gpus, copies),
            "copies": copies,
            "basis": basis,
        }  # fmt: skip
        for gpus in GPUS
        for m in UPDATE_MODELS
    ]


def dominant(lat: float, bw: float) -> str:
    return "latency" if lat > bw else "bandwidth"


def predict(c: Cluster, boba: tuple[int, int], fits: dict) -> list[dict]:
    rows = []
    size, msgs = boba
    for gpus in GPUS:
        train, _ = c.split(gpus)
        for mode, receivers in (("spread", train), ("one_rank", 1)):
            lat, bw = transfer_terms(size, msgs, receivers, *c.link(gpus))
            rows.append(
                {
                    "metric": "predict_gen_to_train_s",
                    "value": lat + bw,
                    "unit": "s",
                    "gpus": gpus,
                    "link": "cluster",
                    "mode": mode,
                    "latency_s": lat,
                    "bandwidth_s": bw,
                    "dominant": dominant(lat, bw),
                    "bytes": size,
                    "msgs": msgs,
                }
            )
        for name, (alpha, beta) in fits.items():
            lat, bw = transfer_terms(size, msgs, train, alpha, beta)
            rows.append(
                {
                    "metric": "predict_gen_to_train_s",
                    "value": lat + bw,
                    "unit": "s",
                    "gpus": gpus,
                    "link": name,
                    "mode": "spread",
                    "latency_s": lat,
                    "bandwidth_s": bw,
                    "dominant": dominant(lat, bw),
                    "bytes": size,
                    "msgs": msgs,
                }
            )
        for model, params in MODELS.items():
            for algo in ("ring", "tree", "p2p"):
                lat, bw = weight_broadcast(c, algo, params, gpus)
                rows.append(
                    {
                        "metric": "predict_weight_broadcast_s",
                        "value": lat + bw,
                        "unit": "s",
                        "gpus": gpus,
                        "model": model,
                        "algo": algo,
                        "latency_s": lat,
                        "bandwidth_s": bw,
                        "dominant": dominant(lat, bw),
                    }
                )
    return rows


# --- rows -------------------------------------------------------------------------------------


def pick(rows: list[dict], **kw) -> dict:
    return next(r for r in rows if all(r.get(k) == v for k, v in kw.items()))


def verdict_rows(rows: list[dict]) -> list[dict]:
    """Each prediction at 1024 GPUs against the claim (gen->train per mode, broadcast per model and algo)."""
    out = []
    for mode in ("spread", "one_rank"):
        t = pick(rows, metric="predict_gen_to_train_s", gpus=1024, link="cluster", mode=mode)
        out.append(
            {
                "metric": "claim_gen_to_train_1024",
                "value": t["value"],
                "unit": "s",
                "mode": mode,
                "under_claim": t["value"] < CLAIM_S,
                "dominant": t["dominant"],
            }
        )
    for model in MODELS:
        for algo in ("ring", "tree", "p2p"):
            b = pick(rows, metric="predict_weight_broadcast_s", gpus=1024, model=model, algo=algo)
            out.append(
                {
                    "metric": "claim_weight_broadcast_1024",
                    "value": b["value"],
                    "unit": "s",
                    "model": model,
                    "algo": algo,
                    "under_claim": b["value"] < CLAIM_S,
                    "dominant": b["dominant"],
                }
            )
    return out


# --- table ------------------------------------------------------------------------------------


def print_report(rows: list[dict], fits: dict, boba: tuple[int, int], source: Optional[str]) -> None:
    print(f"boba batch: {boba[1]} sequences, {boba[0] / GB:.3f} GB (ids int32 + logprobs f32 + versions int32)")
    if fits:
        print(f"\nfitted from {source}:")
        for name, (alpha, beta) in fits.items():
            print(f"  {name:<16} alpha {alpha * 1e6:9.1f} us   beta {beta / GB:7.3f} GB/s")
    else:
        print("\nno measurements given (--from): documented link figures only")
    head = f"{'GPUs':>5} {'g2t spread':>11} {'g2t 1 rank':>11} " + " ".join(
        f"{m + ' ' + a:>11}" for m in MODELS for a in ("ring", "tree", "p2p")
    )
    print(f"\npredicted seconds (claim: under {CLAIM_S:.0f} s at ~1000 GPUs)\n{head}")
    for gpus in GPUS:
        cells = [
            pick(rows, metric="predict_gen_to_train_s", gpus=gpus, link="cluster", mode=m)["value"]
            for m in ("spread", "one_rank")
        ]
        cells += [
            pick(rows, metric="predict_weight_broadcast_s", gpus=gpus, model=m, algo=a)["value"]
            for m in MODELS
            for a in ("ring", "tree", "p2p")
        ]
        print(f"{gpus:>5} " + " ".join(f"{v:>11.4g}" for v in cells))
    print_verdicts(rows)
    print_updates(rows)


def print_updates(rows: list[dict]) -> None:
    ups = [r for r in rows if r["metric"] == "predict_weight_update_s"]
    if not ups:
        return
    cp = ups[0]["copies"]
    print(
        f"\nweight update over NCCL, end to end (a MODEL, not a GPU measurement: ring broadcast + pack "
        f"{cp['pack']:.2f} / verify {cp['verify']:.2f} / load {cp['load']:.2f} copies, measured on CPU)"
    )
    print(f"{'GPUs':>5} " + " ".join(f"{m + ' s':>10} {'(wire)':>8}" for m in UPDATE_MODELS))
    for gpus in (8, 64, 1024):
        cells = [pick(ups, gpus=gpus, model=m) for m in UPDATE_MODELS]
        print(f"{gpus:>5} " + " ".join(f"{r['value']:>10.4g} {r['broadcast_s'] / r['value']:>8.0%}" for r in cells))


def print_verdicts(rows: list[dict]) -> None:
    print()
    for mode in ("spread", "one_rank"):
        t = pick(rows, metric="predict_gen_to_train_s", gpus=1024, link="cluster", mode=mode)
        print(
            f"at 1024 GPUs: gen->train ({mode}) {t['value']:.4g} s ({t['dominant']} term dominates: "
            f"{t['latency_s']:.3g} s latency vs {t['bandwidth_s']:.3g} s bandwidth) -> "
            f"{'under' if t['value'] < CLAIM_S else 'OVER'} the {CLAIM_S:.0f} s claim"
        )
    for r in rows:
        if r["metric"] == "predict_gen_to_train_s" and r["gpus"] == 1024 and r["link"] != "cluster":
            print(
                f"  same batch if every link were {r['link']} (fitted): {r['value']:.3g} s ({r['dominant']} dominates)"
            )
    for model in MODELS:
        over = [
            r["algo"]
            for r in rows
            if r["metric"] == "claim_weight_broadcast_1024" and r["model"] == model and not r["under_claim"]
        ]
        ring = pick(rows, metric="predict_weight_broadcast_s", gpus=1024, model=model, algo="ring")
        print(
            f"at 1024 GPUs: {model} ring broadcast {ring['value']:.3g} s ({ring['dominant']} dominates: "
            f"{ring['latency_s']:.3g} s latency vs {ring['bandwidth_s']:.3g} s bandwidth); over {CLAIM_S:.0f} s: "
            f"{', '.join(over) or 'none of ring/tree/p2p'}"
        )


def read_rows(path: str) -> list[dict]:
    """Rows of a ``--json`` file (a list) or of a results ``.jsonl`` (one row a line)."""
    text = Path(path).read_text()
    return (
        json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    )


def print_control(rows: list[dict]) -> None:
    """The control plane's rows (``benchmarks.common.control_scale``): a MODEL over a measured rate."""
    for r in (r for r in rows if r["metric"] == "predict_scheduler_core_frac"):
        print(
            f"control plane at {r['gpus']} GPUs: {r['messages_per_s']:.0f} messages/s "
            f"({', '.join(f'{k} {v:.0f}' for k, v in r['parts'].items())}) = {r['value']:.3f} of a core at "
            f"{r['rate_messages_per_cpu_s']:.0f} messages per CPU-s ({r['assumptions']})"
        )
    for r in (r for r in rows if r["metric"] == "predict_scheduler_core_frac_by_kind"):
        print(
            f"  by kind: heartbeats measured alone {r['heartbeat_core_frac']:.3f} + the rest at the mix's rate "
            f"{r['rest_core_frac']:.3f} = {r['value']:.3f} of a core"
        )


def main(argv: Optional[list[str]] = None) -> list[dict]:
    a = parse_args(argv)
    measured = json.loads(Path(a.src).read_text()) if a.src else []
    fits = fits_from(measured)
    boba = boba_bytes(a.boba_prompts, a.boba_samples)
    rows = [{"metric": "fit_alpha_s", "value": al, "unit": "s", "transport": k} for k, (al, _) in fits.items()]
    rows += [
        {"metric": "fit_beta_gbps", "value": be / GB, "unit": "GB/s", "transport": k} for k, (_, be) in fits.items()
    ]
    rows += predict(Cluster(a), boba, fits)
    rows += verdict_rows(rows)
    rows += update_rows(Cluster(a), copies_from(measured))
    print_report(rows, fits, boba, a.src)
    if a.scheduler_from:
        sched = read_rows(a.scheduler_from)
        rows += control_rows(sched, a.scheduler_from) + control_rows_by_kind(sched, a.scheduler_from)
        print_control(rows)
    if a.json:
        write_rows(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
