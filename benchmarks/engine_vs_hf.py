"""The embedded engine's tokens/s against ``transformers`` ``generate`` on one model and prompt batch.

    python -m benchmarks.engine_vs_hf [--json PATH] [--hidden 64] [--intermediate 128] [--layers 2]
        [--heads 4] [--kv-heads 4] [--prompts 32] [--samples 8] [--new-tokens 3] [--repeats 10]
        [--no-eos] [--threads 1] [--retained-heap-mb 256]

Both generators get the same model (same dtype), the same prompts, the same number of samples
per prompt, the same ``max_new_tokens``, multinomial sampling at temperature 1 (top-p 1, top-k
off), and a KV cache (``use_cache=True``). ``TorchEngine`` prefills each prompt once and decodes
its n samples on a preallocated cache (``rollout/engines/kv_decoder.py``). HF ``generate`` runs two ways,
and the engine is compared with the faster of the two:

- ``hf_shared``: the same shared prompt prefill: one forward of each prompt but its last token
  into a ``DynamicCache``, the cache repeated for the n samples (``batch_repeat_interleave``),
  then ``generate`` on the n copies of the prompt with that cache (it runs only the last token
  before sampling; the usual HF prefix-cache reuse). Prompts of one token have no prefix to share
  and run as ``hf_expand``.
- ``hf_expand``: ``num_return_sequences=n``: ``generate`` expands each prompt to its n samples
  and prefills every copy.

The process keeps freed heap as a rollout worker does (``--retained-heap-mb``, from
``cluster.retained_heap_mb``), so neither generator pays page faults for blocks it frees and takes
again (how much that moves the ratio: ``benchmarks/RESULTS.md``).

Timing: one warm-up batch each, then ``--repeats`` rounds, each timing one batch of every
generator back to back (the order rotates by round), so all see the same load on a shared
machine; tokens/s of a generator = the median over rounds of (tokens generated / seconds), the
tokens counted up to and including each sample's eos; the same per CPU second in
``*_cpu_tokens_per_s`` (process time, which a loaded machine inflates less than wall time).
The defaults are ``benchmarks.overhead``'s small setup (Llama hidden 64, 2 layers, 16-token
vocabulary, 32 prompts x 8 samples, 3 new tokens); ``--no-eos`` makes every sample run
``--new-tokens`` tokens (a pure throughput case).

JSON rows: ``engine_vs_hf_generate_tokens_per_s_ratio`` (value = engine / HF tokens/s, HF = the
faster of ``hf_shared`` and ``hf_expand``, with every generator's tokens/s, the batch shape and
the 1-minute load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import DynamicCache

from areal_async.base.process import retain_freed_heap, set_torch_threads
from areal_async.config import ClusterConfig, ModelConfig
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from benchmarks import gemm_bound
from benchmarks.common import write_rows

ENGINE_TARGET = 2.0


def measure(
    model,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    repeats: int,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> dict:
    """Median tokens/s of ``TorchEngine`` and of HF ``generate`` (shared prompt prefill and
    per-sample prefill) over interleaved rounds (see above); ``hf_tokens_per_s`` is the faster HF.

    ``eos_id`` None: no eos (every sample runs ``max_new_tokens``)."""
    if repeats < 1 or n < 1 or max_new_tokens < 1 or not prompts:
        raise ValueError(
            f"repeats={repeats}, n={n}, max_new_tokens={max_new_tokens}, {len(prompts)} prompts: need >= 1"
        )
    engine = TorchEngine(model, -1 if eos_id is None else eos_id, seed=seed, max_batch_groups=len(prompts))
    torch.manual_seed(seed)
    run_engine = _engine_batch(engine, prompts, n, max_new_tokens, temperature, top_p)
    hf_args = (model, prompts, n, max_new_tokens, eos_id, pad_id, temperature, top_p)
    runs = [("engine", run_engine), ("hf_shared", _hf_batch(*hf_args, shared=True)), ("hf_expand", _hf_batch(*hf_args))]
    rates: dict[str, list[float]] = {f"{name}{kind}": [] for name, _ in runs for kind in ("", "_cpu")}
    for r in range(-1, repeats):
        k = r % len(runs)
        for name, fn in runs[k:] + runs[:k]:
            t, cpu = time.perf_counter(), time.process_time()
            tokens = fn(r)
            if r >= 0:  # round -1 warms all up
                rates[name].append(tokens / (time.perf_counter() - t))
                rates[f"{name}_cpu"].append(tokens / (time.process_time() - cpu))
    out = {f"{name}_tokens_per_s": statistics.median(v) for name, v in rates.items()}
    best = max(("hf_shared", "hf_expand"), key=lambda name: out[f"{name}_tokens_per_s"])
    out |= {"hf_tokens_per_s": out[f"{best}_tokens_per_s"], "hf_cpu_tokens_per_s": out[f"{best}_cpu_tokens_per_s"]}
    return out | {"hf_baseline": best, "rounds": repeats}


def _engine_batch(engine: TorchEngine, prompts, n, max_new_tokens, temperature, top_p):
    def run(r: int) -> int:
        for i, p in enumerate(prompts):
            engine.add_request(GenRequest(f"r{r}g{i}", p, n, max_new_tokens, temperature, top_p))
        done = []
        while engine.has_work():
            done += engine.step()
        return sum(sum(out.lengths) for out in done)

    return run


def _hf_batch(model, prompts, n, max_new_tokens, eos_id, pad_id, temperature, top_p, shared: bool = False):
    """A function of the round that runs one batch of ``hf_generate`` and returns its token count."""
    gen = hf_generate(model, prompts, n, max_new_tokens, eos_id, pad_id, temperature, top_p, shared)

    def run(r: int) -> int:
        new = gen()
        return int(new.numel() if eos_id is None else tokens_until_eos(new, eos_id).sum())

    return run


def hf_generate(model, prompts, n, max_new_tokens, eos_id, pad_id, temperature, top_p, shared: bool = False):
    """A function that samples n continuations of every prompt with HF ``generate`` and returns the
    new tokens (G * n, max_new_tokens), prompt-major: ``shared`` prefills each prompt's prefix
    once and repeats its cache for the n samples (see the module docstring), else
    ``num_return_sequences=n``."""
    T = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    shared = shared and T > 1

    def prefill_prefix() -> dict:
        """generate's inputs: the n copies of each prompt and the cache of their prefix."""
        cache = DynamicCache(config=model.config)
        prefix = mask[:, :-1]
        model.base_model(
            input_ids=ids[:, :-1],
            attention_mask=prefix,
            position_ids=(prefix.cumsum(1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
        )
        cache.batch_repeat_interleave(n)
        return {
            "input_ids": ids.repeat_interleave(n, 0),
            "attention_mask": mask.repeat_interleave(n, 0),
            "past_key_values": cache,
        }

    def run() -> torch.Tensor:
        with torch.inference_mode():
            inputs = prefill_prefix() if shared else {"input_ids": ids, "attention_mask": mask}
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=1 if shared else n,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
                use_cache=True,
            )
        return out[:, T:]

    return run


def tokens_until_eos(new_BT: torch.Tensor, eos: int) -> torch.Tensor:
    """Generated tokens per row, counting the first eos and nothing after it (HF pads after it)."""
    is_eos = (new_BT == eos).int()
    before_first = is_eos.cumsum(1) - is_eos == 0
    return before_first.sum(1)


def ratio_row(gen: dict, **meta) -> dict:
    ratio = gen["engine_tokens_per_s"] / gen["hf_tokens_per_s"]
    return {
        "metric": "engine_vs_hf_generate_tokens_per_s_ratio",
        "value": ratio,
        "unit": "ratio",
        **gen,
        "target": ENGINE_TARGET,
        "meets_target": ratio >= ENGINE_TARGET,
        **meta,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="where to write the JSON list of rows")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the built Llama")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per batch ('a+b=', 5 tokens)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=3, help="max_new_tokens")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds")
    ap.add_argument("--no-eos", action="store_true", help="no eos: every sample runs --new-tokens tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the rollout worker's default is 1)")
    ap.add_argument(
        "--shapes",
        default="",
        help="comma list of benchmarks.gemm_bound shapes (tiny, real): one row per width, in this run, each with "
        "the engine's and HF's fraction of the bare-matmul decode bound (replaces the --hidden.. model)",
    )
    ap.add_argument(
        "--retained-heap-mb",
        type=int,
        default=ClusterConfig().retained_heap_mb,
        help="freed heap kept in the process, as a rollout worker keeps (cluster.retained_heap_mb); 0 = glibc's",
    )
    return ap


def width_rows(args) -> list[dict]:
    """``--shapes``: the same batch at each width; engine and HF tokens/s beside the GEMM bound of a decode step
    (``benchmarks.gemm_bound``: every linear layer for prompts x samples rows, nothing else)."""
    rows = []
    for shape in args.shapes.split(","):
        cfg = gemm_bound.model_config(shape, max_position_embeddings=max(32, 8 + args.new_tokens))
        model = build_model(cfg, cfg.vocab_size, seed=1)
        g = torch.Generator().manual_seed(0)
        prompts = [[1, *torch.randint(3, cfg.vocab_size, (4,), generator=g).tolist()] for _ in range(args.prompts)]
        load0 = os.getloadavg()[0]
        gen = measure(model, prompts, args.samples, args.new_tokens, None, 0, args.repeats)
        rows_ = args.prompts * args.samples
        bound = rows_ / gemm_bound.decode_step_s(gemm_bound.linear_shapes(cfg, cfg.vocab_size), rows_)
        meta = {
            "shape": shape,
            "model": f"{cfg.arch} hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}",
            "batch": f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, no eos",
            "gemm_bound_tokens_per_s": bound,
            "engine_fraction_of_gemm_bound": gen["engine_tokens_per_s"] / bound,
            "hf_fraction_of_gemm_bound": gen["hf_tokens_per_s"] / bound,
            "threads": args.threads,
            "loadavg_before": load0,
            "loadavg_after": os.getloadavg()[0],
        }
        rows.append(ratio_row(gen, **meta))
        print(
            f"{shape} ({meta['model']}; {meta['batch']}): engine {gen['engine_tokens_per_s']:.0f} tokens/s "
            f"({meta['engine_fraction_of_gemm_bound']:.2f} of the GEMM bound {bound:.0f}), HF "
            f"{gen['hf_tokens_per_s']:.0f} ({meta['hf_fraction_of_gemm_bound']:.2f}): {rows[-1]['value']:.2f}x; "
            f"load {load0:.1f} -> {meta['loadavg_after']:.1f}"
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    set_torch_threads(args.threads)
    retain_freed_heap(args.retained_heap_mb)
    if args.shapes:
        rows = width_rows(args)
        if args.json:
            write_rows(args.json, rows)
        return rows
    tok = build_char_tokenizer("0123456789+=")
    mcfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=max(32, 8 + args.new_tokens),
    )
    model = build_model(mcfg, len(tok), seed=1)
    prompts = [
        [tok.bos_token_id, *tok.encode(f"{i % 10}+{i // 10 % 10}=", add_special_tokens=False)]
        for i in range(args.prompts)
    ]
    load0 = os.getloadavg()[0]
    gen = measure(
        model,
        prompts,
        args.samples,
        args.new_tokens,
        None if args.no_eos else tok.eos_token_id,
        tok.pad_token_id,
        args.repeats,
    )
    meta = {
        "batch": f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens"
        + (", no eos" if args.no_eos else ""),
        "model": f"llama hidden {args.hidden}, {args.layers} layers, vocab {len(tok)}",
        "threads": args.threads,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    row = ratio_row(gen, **meta)
    print(
        f"{meta['model']}; {meta['batch']}: engine {gen['engine_tokens_per_s']:.0f} tokens/s, transformers generate "
        f"{gen['hf_tokens_per_s']:.0f} tokens/s ({gen['hf_baseline']}; shared prefill "
        f"{gen['hf_shared_tokens_per_s']:.0f}, per-sample prefill {gen['hf_expand_tokens_per_s']:.0f}): "
        f"{row['value']:.2f}x (target >= {ENGINE_TARGET}x); per CPU second "
        f"{gen['engine_cpu_tokens_per_s']:.0f} vs {gen['hf_cpu_tokens_per_s']:.0f}: "
        f"{gen['engine_cpu_tokens_per_s'] / gen['hf_cpu_tokens_per_s']:.2f}x; "
        f"load {load0:.2f} -> {meta['loadavg_after']:.2f}"
    )
    if args.json:
        write_rows(args.json, [row])
    return [row]


if __name__ == "__main__":
    main()
