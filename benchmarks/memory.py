"""Peak memory a trainer step adds above the resident model and optimizer state: the lm head's
logits chunked (``actor.logits_chunk_tokens``) vs whole, with and without activation checkpointing,
across micro-batch sizes and vocabularies; the logits term predicted by formula beside each.

    python -m benchmarks.memory [--json out.json] [--quick]

Each case runs in a fresh child process (no allocator state carried between cases): a Qwen2-style
model (tied embeddings, ``--hidden`` wide, ``--layers`` deep, the given vocabulary), AdamW, one
warm-up step on 16 tokens (grads and optimizer state allocated, then grads freed as the actor's
``zero_grad`` does); then the peak counter is reset (Linux: ``/proc/self/clear_refs`` 5 resets
VmHWM) and one step is measured: ``forward_packed`` with entropy (a statistic, entropy_coef 0, as
boba), a token-mean policy-gradient loss, backward, optimizer step. Added = peak - resident before
the step; both absolute figures are in the rows. On CUDA the same with ``max_memory_allocated``
(``reset_peak_memory_stats`` before the step) - that code path has NOT been run here (no GPU on
this machine). Each child runs under an address-space limit (``--max-gb``) so a case that would
exhaust the shared machine fails in its own process instead.

Formula for the logits term (float32, V vocabulary, T tokens of the micro-batch, C chunk):
  whole:   5 T V 4 B: in backward the logits (kept by logsumexp), logsumexp's x - lse and its exp,
           the gather's scattered gradient and the sum of the two gradients
  chunked: 3 min(C, T) V 4 B (one chunk's log p, p and gradient) + V E 4 B (the head's weight
           gradient accumulated in float32; for a float32 model that is the gradient itself)
Measured figures against the formula, with commit and load: ``benchmarks/RESULTS.md``.
``predict_boba`` states the per-rank GPU peak of ``configs/boba_grpo.yaml`` (1.5B, 16384 tokens
per micro-batch, 4 FSDP ranks) by the same formula plus parameter, optimizer and activation terms.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys

import torch
import transformers

from areal_async.trainer.actor import enable_checkpointing
from areal_async.trainer.compute.chunked_head import DEFAULT_CHUNK_TOKENS
from areal_async.trainer.compute.packing import forward_packed, pack, use_varlen_attention
from benchmarks.common import write_rows

VOCABS = (32000, 151936)
BIG_V, BIG_T = 151936, 4096


def logits_term(tokens: int, vocab: int, chunk: int, hidden: int) -> int:
    """Predicted bytes of the logits term (module docstring)."""
    if chunk == 0 or chunk >= tokens:
        return 5 * tokens * vocab * 4
    return 3 * chunk * vocab * 4 + vocab * hidden * 4


# --------------------------------------------------------------------------------------------
# the child: one measured step
# --------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _build(vocab: int, hidden: int, layers: int, ckpt: bool):
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=1,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = use_varlen_attention(transformers.Qwen2ForCausalLM(cfg)).train()
    if ckpt:
        enable_checkpointing(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def _step(model, opt, packed, chunk: int) -> None:
    logp, ent = forward_packed(model, packed, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=chunk)
    (-(logp * 0.5).mean()).backward()
    opt.step()
    opt.zero_grad()
    del logp, ent


def child(case: dict) -> dict:
    """Measure one case in this process (see the module docstring)."""
    torch.set_num_threads(case.get("threads", 2))
    device = case.get("device", "cpu")
    model, opt = _build(case["vocab"], case["hidden"], case["layers"], case["ckpt"])
    model.to(device)
    g = torch.Generator().manual_seed(1)
    seq = case["seq_len"]
    packed = pack([torch.randint(0, case["vocab"], (seq,), generator=g) for _ in range(case["tokens"] // seq)])
    _step(model, opt, pack([list(range(16))]), case["chunk"])
    gc.collect()
    if device.startswith("cuda"):  # written for the GPU machine; not run here
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, opt, packed, case["chunk"])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        base = _rss_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        _step(model, opt, packed, case["chunk"])
        peak = _rss_kib("VmHWM") * 1024
    return dict(case, resident_bytes=base, peak_bytes=peak, added_bytes=peak - base)


# --------------------------------------------------------------------------------------------
# the parent: cases in fresh children, rows
# --------------------------------------------------------------------------------------------


def run_case(case: dict, max_gb: float, timeout_s: float = 900) -> dict:
    limit = int(max_gb * 2**30)

    def cap():  # in the child: allocations past the cap fail there (MemoryError), not the machine
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--child", json.dumps(case)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=cap,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(args) -> list[dict]:
    base = dict(hidden=args.hidden, layers=args.layers, seq_len=512, threads=args.threads, device=args.device)
    if args.quick:  # a smoke size: small vocab, 2,048 tokens, chunks of 256
        grid = [(4096, 2048, c, False) for c in (0, 256)]
    else:
        grid = [(BIG_V, BIG_T, c, k) for c, k in ((0, False), (args.chunk, False), (args.chunk, True))]
        grid += [(BIG_V, 2048, c, False) for c in (0, args.chunk)]
        grid += [(32000, BIG_T, c, False) for c in (0, args.chunk)]
        grid += [(BIG_V, BIG_T, 0, True)]  # last: the slowest case (whole logits, recomputed layers)
    return [dict(base, vocab=v, tokens=t, chunk=c, ckpt=k) for v, t, c, k in grid][args.start :]


def row_of(res: dict) -> dict:
    pred = logits_term(res["tokens"], res["vocab"], res["chunk"], res["hidden"])
    keys = ("vocab", "tokens", "chunk", "ckpt", "hidden", "layers", "device", "resident_bytes", "peak_bytes")
    return dict(
        metric="trainer_step_added_bytes",
        value=res["added_bytes"],
        unit="bytes",
        **{k: res[k] for k in keys},
        predicted_logits_bytes=pred,
        bound="peak RSS (VmHWM) - RSS before the step" if res["device"] == "cpu" else "max_memory_allocated - before",
    )


def ratio_rows(rows: list[dict], chunk: int) -> list[dict]:
    """trainer_peak_ratio_chunked_vs_whole per (vocab, tokens, ckpt) measured both ways."""
    out = []
    by = {(r["vocab"], r["tokens"], r["ckpt"], r["chunk"]): r for r in rows}
    for (v, t, k, c), r in sorted(by.items()):
        whole = by.get((v, t, k, 0))
        if c == chunk and whole is not None:
            out.append(
                dict(
                    metric="trainer_peak_ratio_chunked_vs_whole",
                    value=r["value"] / whole["value"],
                    unit="ratio",
                    vocab=v,
                    tokens=t,
                    chunk=c,
                    ckpt=k,
                    bound="<= 0.25 asked (issue 25)",
                )
            )
    return out


# DeepSeek-R1-Distill-Qwen-1.5B (its config.json): untied head
R1_1P5B = dict(vocab=151936, hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, head_dim=128)
BOBA_TOKENS, BOBA_RANKS, BOBA_CHUNK = 16384, 4, 1024


def r1_params(m: dict = R1_1P5B) -> int:
    kv = m["kv_heads"] * m["head_dim"]
    E = m["hidden"]
    attn = E * E * 2 + E * kv * 2 + E + 2 * kv  # q, o; k, v; q/k/v biases
    layer = attn + 3 * E * m["inter"] + 2 * E
    return 2 * m["vocab"] * E + m["layers"] * layer + E


def predict_boba() -> list[dict]:
    """configs/boba_grpo.yaml's GPU peak per trainer rank, by formula (assumptions in each row)."""
    m, T, P = R1_1P5B, BOBA_TOKENS, r1_params()
    E, V, L = m["hidden"], m["vocab"], m["layers"]
    state = 16 * P // BOBA_RANKS  # fp32 master params + grads + Adam m, v, sharded over the ranks
    gathered = 2 * (2 * V * E) + 2 * 2 * (P - 2 * V * E) // L + 4 * 2 * V * E  # root + 2 layers bf16, root grads fp32
    act_layer = (10 * E + 4 * m["inter"]) * 2  # bytes saved per token per layer (bf16), lean forward's tensors
    rows = []
    for ckpt in (False, True):
        acts = T * (L * E * 2 + act_layer) if ckpt else T * L * act_layer
        for chunk in (0, BOBA_CHUNK):
            logits = logits_term(T, V, chunk, E)
            rows.append(
                dict(
                    metric="boba_grpo_gpu_peak_per_rank_predicted_bytes",
                    value=state + gathered + acts + logits,
                    unit="bytes",
                    params=P,
                    tokens=T,
                    ranks=BOBA_RANKS,
                    chunk=chunk,
                    ckpt=ckpt,
                    state_bytes=state,
                    gathered_bytes=gathered,
                    activation_bytes=acts,
                    logits_bytes=logits,
                    bound=(
                        "formula: 16 B/param sharded over 4 ranks (fp32 master, grads, Adam m+v); the root "
                        "(embedding + head) and two layers gathered in bf16, the root's grads fp32; activations "
                        "(10 E + 4 I) x 2 B per token per layer (checkpointed: each layer's input, E x 2 B, plus "
                        "one layer's); the logits term of this module; not counted: allocator fragmentation, "
                        "NCCL buffers, the CUDA context (~0.5-1 GB). NOTE: the FSDP trainer takes the whole-logits "
                        "path today (chunked_head does not cover FSDP models): chunk>0 rows are what it would be"
                    ),
                )
            )
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="two small cases (tests)")
    ap.add_argument("--start", type=int, default=0, help="skip the grid's first cases (resume a run)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-gb", type=float, default=16.0, help="address-space cap of each child")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    args.chunk = 256 if args.quick else DEFAULT_CHUNK_TOKENS
    rows = []
    for case in cases(args):
        rows.append(row_of(run_case(case, args.max_gb)))
        print(json.dumps(rows[-1]), flush=True)
    rows += ratio_rows(rows, args.chunk) + predict_boba()
    load = os.getloadavg()
    for r in rows:
        r["load_avg_1m"] = round(load[0], 2)
    if args.json:
        write_rows(args.json, rows)
    for r in rows[len(rows) - len(predict_boba()) - 4 :]:
        print(json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
