"""The bare-matmul bound of a model's work, and what fraction of it the engine and the trainer reach.

    python -m benchmarks.gemm_bound [--json PATH] [--shape tiny|real] [--tokens 2048] [--threads 2]
        [--repeats 3] [--skip-hf]

A Llama/Qwen2 decoder's arithmetic is its linear layers (q/k/v, o, gate/up, down in every layer,
and the lm head) plus attention, norms, RoPE and sampling. The bound times the linear layers
alone: the same GEMM shapes on random tensors of the model's dtype, back to back with no Python in
between (one ``torch.mm`` per shape into preallocated outputs), on the same threads. Whatever a
generator or a trainer spends above it is attention, elementwise work, Python and memory traffic;
a fraction near 1 leaves nothing but faster GEMMs (a GPU) to gain.

- decode: one token for ``rows`` rows is ``rows x in`` by ``in x out`` (``x @ W.T``) for every shape
  (``decode_step_s``); the generators' tokens/s bound = rows / that time (prefill excluded: the
  prompts are a few tokens). ``benchmarks.engine_vs_hf --shapes tiny,real`` puts engine and HF
  tokens/s beside it, per width.
- train: forward ``x @ W.T``, backward ``dY @ W`` (dX) and ``dY.T @ x`` (dW), every shape, lm head
  included (``train_step_s``), each in the memory layout ``nn.Linear`` and autograd use (a bound timed
  in other layouts measured slower than the real step here: layouts matter to the BLAS). ``main`` times
  the trainer's fused step (``packing.forward_packed`` with the chunked head, then backward) and a
  plain HF forward + log-softmax + backward of the same packed tokens beside it. The bound, the fused
  step and the HF step are timed in interleaved rounds (each once per round, the order rotated round to
  round, ``--repeats`` rounds after one warm-up each): every row carries its samples and the medians.
  ``trainer_fused_step_vs_hf_plain_step`` is the fused step's time over the HF step's, the median of the
  rounds' ratios (> 1: the fused step is slower; at the real shape it is: 27 % at 1,024 tokens in a
  one-repeat run of 2026-12-02, 24 % in five interleaved rounds of 2026-12-06: RESULTS.md). The chunked
  head recomputes each chunk's logits in backward, one more head GEMM than the bound counts
  (``head_recompute_s``, reported so a reader can add it): at the real shape (2 layers, a 151,936-token
  vocabulary) the head is most of the GEMM work, and that recompute (1.9 s of a 13 s step there) is most
  of what the fused step pays over HF for not holding the T x V logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from areal_async.base.process import set_torch_threads
from areal_async.config import ModelConfig
from areal_async.models.tiny import build_model
from areal_async.trainer.compute.packing import forward_packed, pack, use_varlen_attention
from benchmarks.common import write_rows

SHAPES = {
    # benchmarks.overhead's small Llama; the real shape is configs/real_shape.yaml's (Qwen2.5-0.5B at 2 layers)
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=16),
    "real": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
}  # fmt: skip


def model_config(shape: str, **over) -> ModelConfig:
    return ModelConfig(**{**SHAPES[shape], "max_position_embeddings": 4096, **over})


def linear_shapes(cfg: ModelConfig, vocab: int) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one forward, lm head last."""
    E, M, D = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * D
    layer = [(E, E), (E, kv), (E, kv), (E, E), (E, M), (E, M), (M, E)]  # q k v o gate up down
    return layer * cfg.num_hidden_layers + [(E, vocab)]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _mm_plan(products: list[tuple[str, int, int, int]], dtype: torch.dtype):
    """Products in the layouts ``nn.Linear`` runs (weight ``W`` stored (out, in), activations (T, features)),
    operands and outputs allocated once, so the timed loop only multiplies:
    ("fwd", T, in, out): x @ W.T;  ("dx", T, in, out): dY @ W;  ("dw", T, in, out): dY.T @ x."""
    ops = []
    for kind, T, i, o in products:
        w, x, dy = torch.randn(o, i, dtype=dtype), torch.randn(T, i, dtype=dtype), torch.randn(T, o, dtype=dtype)
        a, b = {"fwd": (x, w.t()), "dx": (dy, w), "dw": (dy.t(), x)}[kind]
        ops.append((a, b, torch.empty(a.shape[0], b.shape[1], dtype=dtype)))

    def run():
        for a, b, out in ops:
            torch.mm(a, b, out=out)

    return run


def interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` (name -> callable) per round: one warm-up each, then ``repeats`` rounds that
    time every one once, the order rotated by one each round (no fn always first or last)."""
    names = list(fns)
    for name in names:
        fns[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t)
    return out


def decode_step_s(shapes, rows: int, dtype=torch.float32, repeats: int = 5) -> float:
    """Seconds of the GEMMs of one decode step of ``rows`` rows."""
    return timed(_mm_plan([("fwd", rows, i, o) for i, o in shapes], dtype), repeats)


def train_step_s(shapes, tokens: int, dtype=torch.float32, repeats: int = 3) -> float:
    """Seconds of the GEMMs of a forward and backward over ``tokens`` packed tokens."""
    products = [(kind, tokens, i, o) for i, o in shapes for kind in ("fwd", "dx", "dw")]
    return timed(_mm_plan(products, dtype), repeats)


def trainer_rows(shape: str, tokens: int, repeats: int, skip_hf: bool) -> list[dict]:
    """The trainer's fused step and a plain HF step on ``tokens`` packed tokens, each against the GEMM bound."""
    cfg = model_config(shape)
    model = use_varlen_attention(build_model(cfg, cfg.vocab_size, seed=0)).train()
    g = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(0, cfg.vocab_size, (512,), generator=g) for _ in range(max(1, tokens // 512))])
    T = packed.ids_T.numel()

    def fused():
        logp, _ = forward_packed(model, packed, with_entropy=True, entropy_grad=False, chunk_tokens=1024)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    def plain():
        kw = dict(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens)
        kw |= dict(max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen)
        out = model(input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **kw)
        logq = torch.log_softmax(out.logits[0].float(), -1)
        logq.gather(-1, torch.roll(packed.ids_T, -1)[:, None]).sum().backward()
        model.zero_grad(set_to_none=True)

    shapes = linear_shapes(cfg, cfg.vocab_size)
    products = [(kind, T, i, o) for i, o in shapes for kind in ("fwd", "dx", "dw")]
    fns = {"bound": _mm_plan(products, torch.float32), "recompute": _mm_plan([("fwd", T, *shapes[-1])], torch.float32)}
    fns |= {"trainer_fused_step": fused} | ({} if skip_hf else {"hf_plain_step": plain})
    got = interleaved(fns, repeats)  # the chunked head's second logits GEMM: "recompute"
    recompute = statistics.median(got["recompute"])
    rows = [_train_row(what, shape, T, got[what], got["bound"], recompute) for what in fns if what.endswith("_step")]
    if not skip_hf:
        rows.append(_vs_hf(shape, T, got, recompute))
    return rows


def _train_row(what: str, shape: str, T: int, steps: list[float], bounds: list[float], recompute_s: float) -> dict:
    step_s, bound_s = statistics.median(steps), statistics.median(bounds)
    return {
        "metric": f"{what}_fraction_of_gemm_bound",
        "value": bound_s / step_s,
        "unit": "ratio",
        "shape": shape,
        "tokens": T,
        "step_s": step_s,
        "step_s_samples": [round(x, 4) for x in steps],
        "tokens_per_s": T / step_s,
        "gemm_bound_s": bound_s,
        "gemm_bound_s_samples": [round(x, 4) for x in bounds],
        "head_recompute_s": recompute_s,
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg()[0],
        "timing": "interleaved rounds (gemm_bound.interleaved), medians",
    }


def _vs_hf(shape: str, T: int, got: dict, recompute_s: float) -> dict:
    """The trainer's fused step over a plain HF step: the median of their ratios round by round (each round
    times both within seconds of each other, so a load that drifts between rounds cancels), with each
    round's ratio and both medians beside it."""
    per_round = [f / h for f, h in zip(got["trainer_fused_step"], got["hf_plain_step"])]
    ratio = statistics.median(per_round)
    fused, hf = statistics.median(got["trainer_fused_step"]), statistics.median(got["hf_plain_step"])
    return {
        "metric": "trainer_fused_step_vs_hf_plain_step",
        "value": ratio,
        "unit": "ratio",
        "shape": shape,
        "tokens": T,
        "ratio_per_round": [round(x, 4) for x in per_round],
        "fused_step_s": fused,
        "hf_step_s": hf,
        "head_recompute_s": recompute_s,
        "said": f"the trainer's fused step is {abs(ratio - 1):.0%} {'slower' if ratio > 1 else 'faster'} than a "
        f"plain HF step at the {shape} shape ({T} tokens, median of {len(per_round)} interleaved rounds; its "
        f"chunked head's recompute: {recompute_s:.2f} s of {fused:.2f} s)",
        "loadavg": os.getloadavg()[0],
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="where to write the JSON list of rows")
    ap.add_argument("--shape", default="real", choices=sorted(SHAPES), help="model shape of the trainer rows")
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens of the trainer step (512-token sequences)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the trainer's default: every core)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (medians)")
    ap.add_argument("--skip-hf", action="store_true", help="no plain HF step (it holds the whole T x V logits)")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    set_torch_threads(args.threads)
    rows = trainer_rows(args.shape, args.tokens, args.repeats, args.skip_hf)
    for r in rows:
        if "said" in r:
            print(r["said"])
            continue
        print(
            f"{r['metric']} ({r['shape']}, {r['tokens']} tokens): {r['value']:.2f} (step {r['step_s']:.2f} s, "
            f"{r['tokens_per_s']:.0f} tokens/s; GEMM bound {r['gemm_bound_s']:.2f} s, + head recompute "
            f"{r['head_recompute_s']:.2f} s; load {r['loadavg']:.1f})"
        )
    if args.json:
        write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
