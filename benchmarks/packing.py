"""Packing: padding waste and micro-batch counts, padded batching vs our allocator, and CPU
trainer throughput packed vs padded.

    python -m benchmarks.packing --json out.json [--n 512] [--seed 0]

Part 1 (allocation only, no model): ``n`` sequence lengths drawn lognormal (median 4000 tokens,
sigma 0.9, capped at 27000, the boba generation limit), micro-batch budget 16384 tokens.
- padded: sequences in arrival order, each micro-batch padded to its longest member, filled
  while (members x longest) fits the budget (a sequence over the budget alone);
- packed: ``allocate_micro_batches`` (FFD + Karmarkar-Karp, ``oversize='own_mb'``), no padding;
- lower bounds: ceil(total / budget) as asked, and the tighter one for own_mb,
  n_oversize + ceil(rest / budget) (an oversize sequence cannot share its micro-batch).
Part 2 (timing): the same generator scaled down 32x (median 125, cap 843, budget 512 tokens,
64 sequences) so a tiny Llama (vocab 1024, hidden 64, 2 layers) trains on one CPU thread in
well under a minute; forward + backward of a token-mean NLL, best of ``--repeats`` passes.
Packed is timed with the CPU trainer's attention ('packed_sdpa': causal sdpa per sequence) and,
for reference, with sdpa + the dense (1, 1, T, T) block mask. tokens/s counts real tokens only.
Not measured: GPU kernels (flash-attn varlen), real model sizes.
Each JSON row: metric, value, unit, bound (what limits or defines the figure), part.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import transformers

from areal_async.trainer.compute.packing import forward_packed, pack, select_attn_implementation
from areal_async.trainer.compute.micro_batches import allocate_micro_batches, lower_bound
from benchmarks.common import write_rows

BUDGET, CAP, MEDIAN, SIGMA = 16384, 27000, 4000, 0.9
SCALE = 32  # part 2: lengths, cap and budget divided by this


def lognormal_lengths(n: int, seed: int, median: float = MEDIAN, cap: int = CAP) -> list[int]:
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(math.log(median), SIGMA, size=n)
    return [int(min(cap, max(2, round(x)))) for x in raw]


def padded_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Arrival order; a micro-batch grows while (size + 1) * longest stays within the budget."""
    bins: list[list[int]] = []
    cur: list[int] = []
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(n, max(lengths[j] for j in cur)) > budget:
            bins.append(cur)
            cur = []
        cur.append(i)
    return bins + [cur] if cur else bins


def padding_tokens(bins: list[list[int]], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in bins)


# --------------------------------------------------------------------------------------------
# part 1
# --------------------------------------------------------------------------------------------


def allocation_rows(n: int, seed: int) -> list[dict]:
    lengths = lognormal_lengths(n, seed)
    padded = padded_micro_batches(lengths, BUDGET)
    t0 = time.perf_counter()
    packed = allocate_micro_batches(lengths, BUDGET, oversize="own_mb")
    alloc_s = time.perf_counter() - t0
    big = [x for x in lengths if x > BUDGET]
    rest = [x for x in lengths if x <= BUDGET]
    loads = [sum(lengths[i] for i in b) for b in packed if len(b) > 1 or lengths[b[0]] <= BUDGET]
    packed_pad = sum(pack([[0] * lengths[i] for i in b]).ids_T.numel() for b in packed) - sum(lengths)

    def r(metric, value, unit, bound):
        return {"metric": metric, "value": value, "unit": unit, "bound": bound, "part": "allocation"}

    return [
        r("sequences", n, "count", f"lognormal median {MEDIAN}, sigma {SIGMA}, cap {CAP}, seed {seed}"),
        r("total_tokens", sum(lengths), "tokens", "sum of lengths"),
        r("oversize_sequences", len(big), "count", f"longer than max_tokens_per_mb={BUDGET}: own micro-batch"),
        r("padding_tokens_padded", padding_tokens(padded, lengths), "tokens", "arrival-order padded batching"),
        r("padding_tokens_packed", packed_pad, "tokens", "packed 1D tensors: 0 by construction"),
        r("microbatches_padded", len(padded), "count", "arrival-order padded batching"),
        r("microbatches_packed", len(packed), "count", "FFD + Karmarkar-Karp, oversize own_mb"),
        r("microbatches_lower_bound", lower_bound(lengths, BUDGET), "count", f"ceil(total/{BUDGET})"),
        r(
            "microbatches_lower_bound_own_mb",
            len(big) + lower_bound(rest, BUDGET),
            "count",
            "n_oversize + ceil(rest/budget)",
        ),
        r("packed_mb_tokens_max", max(loads), "tokens", f"<= {BUDGET} (shared micro-batches)"),
        r("packed_mb_tokens_min", min(loads), "tokens", "balance: close to max"),
        r("allocator_time", alloc_s * 1e3, "ms", "pure Python, one CPU core"),
    ]


# --------------------------------------------------------------------------------------------
# part 2
# --------------------------------------------------------------------------------------------


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).train()


def _packed_pass(model, seqs, budget) -> None:
    n_tok = sum(len(s) - 1 for s in seqs)
    for mb in allocate_micro_batches([len(s) for s in seqs], budget, oversize="own_mb"):
        p = pack([seqs[i] for i in mb])
        logp_T, _ = forward_packed(model, p)
        keep_T = torch.ones_like(logp_T, dtype=torch.bool)
        keep_T[(p.cu_seqlens[1:] - 1).long()] = False  # each sequence's last position scores nothing
        (-(logp_T * keep_T).sum() / n_tok).backward()


def _padded_pass(model, seqs, budget) -> None:
    n_tok = sum(len(s) - 1 for s in seqs)
    for mb in padded_micro_batches([len(s) for s in seqs], budget):
        L = max(len(seqs[i]) for i in mb)
        ids_BL = torch.zeros(len(mb), L, dtype=torch.long)
        mask_BL = torch.zeros(len(mb), L, dtype=torch.long)
        for row, i in enumerate(mb):
            ids_BL[row, : len(seqs[i])] = torch.tensor(seqs[i])
            mask_BL[row, : len(seqs[i])] = 1
        logits = model(input_ids=ids_BL, attention_mask=mask_BL, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids_BL[:, 1:, None])[..., 0]
        (-(logp * mask_BL[:, 1:]).sum() / n_tok).backward()


def _best_time(fn, model, seqs, budget, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn(model, seqs, budget)
        best = min(best, time.perf_counter() - t0)
    return best


def timing_rows(seed: int, repeats: int, n: int = 64) -> list[dict]:
    torch.set_num_threads(1)
    lengths = lognormal_lengths(n, seed + 1, median=MEDIAN / SCALE, cap=CAP // SCALE)
    budget = BUDGET // SCALE
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 1024, size=x).tolist() for x in lengths]
    model = tiny_model()
    t_padded = _best_time(_padded_pass, model, seqs, budget, repeats)
    t_mask = _best_time(_packed_pass, model, seqs, budget, repeats)  # sdpa + dense block mask
    model.set_attn_implementation(select_attn_implementation("cpu"))  # what a CPU trainer loads
    t_varlen = _best_time(_packed_pass, model, seqs, budget, repeats)
    tokens = sum(lengths)
    note = (
        f"scaled-down mix for CPU: {n} seqs, lengths/{SCALE} (median {MEDIAN // SCALE}, cap {CAP // SCALE}), "
        f"budget {budget}, tiny Llama, 1 thread, best of {repeats}"
    )

    def r(metric, value, unit):
        return {"metric": metric, "value": value, "unit": unit, "bound": note, "part": "timing"}

    return [
        r("tokens_per_s_padded", tokens / t_padded, "tokens/s"),
        r("tokens_per_s_packed", tokens / t_varlen, "tokens/s"),
        r("tokens_per_s_packed_dense_mask", tokens / t_mask, "tokens/s"),
        r("tokens_per_s_ratio_packed_vs_padded", t_padded / t_varlen, "x"),
        r("tokens_per_s_ratio_packed_dense_mask_vs_padded", t_padded / t_mask, "x"),
        r("timing_padding_tokens_padded", padding_tokens(padded_micro_batches(lengths, budget), lengths), "tokens"),
        r("timing_total_tokens", tokens, "tokens"),
    ]


def _print_table(rows: list[dict]) -> None:
    print(f"{'metric':40s} {'value':>14s}  unit")
    for row in rows:
        v = row["value"]
        print(
            f"{row['metric']:40s} {v:>14.4g}  {row['unit']}"
            if isinstance(v, float)
            else f"{row['metric']:40s} {v:>14}  {row['unit']}"
        )
    print(f"timing part: {rows[-1]['bound']}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the JSON list of rows")
    ap.add_argument("--n", type=int, default=512, help="sequences in the allocation part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timing passes per path (best is kept)")
    args = ap.parse_args(argv)
    rows = allocation_rows(args.n, args.seed) + timing_rows(args.seed, args.repeats)
    _print_table(rows)
    write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
