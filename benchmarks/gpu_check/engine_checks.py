"""The embedded engine's decode on the device against HF ``generate`` on the same device (the one-GPU layout's
rollout engine: ``TorchEngine`` with its lean Llama decoder and preallocated KV cache).

``engine_decode_vs_hf``: the tiny Llama (float32; TF32 off, torch's default for matmuls) decodes prompts of four
lengths in one batch, greedy, 12 new tokens, no eos; each sample's tokens must be the ones HF ``generate`` picks
for its prompt alone, and each token's logprob log_softmax of HF's own logits at that step within 1e-4 (CPU:
1e-5, as tests/unit/rollout/test_engine_torch.py holds it). CPU twin: the same on the host.
"""

from __future__ import annotations

import torch

from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from benchmarks.gpu_check.models import tiny_model
from benchmarks.gpu_check.registry import Result

PROMPTS = [[5, 9, 3, 17], [7], [11, 2, 40, 33, 8, 21, 6, 19, 4], [30, 31]]  # mixed lengths: padding must not leak
NEW_TOKENS = 12


def _engine_outputs(model, dev: str) -> dict[str, list]:
    engine = TorchEngine(model, -1, device=dev, seed=0, version=0)  # eos -1: every sample runs NEW_TOKENS
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenRequest(f"g{i}", list(p), n=2, max_new_tokens=NEW_TOKENS, greedy=True))
    done = {}
    while engine.has_work():
        done.update({o.group_id: o for o in engine.step()})
    return {g: [(s.output_ids.tolist(), s.logprobs.float().cpu()) for s in o.samples()] for g, o in done.items()}


@torch.no_grad()
def _hf(model, prompt: list[int], dev: str) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device=dev)
    ref = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = ref.sequences[0, ids.shape[1] :]
    logp = torch.stack([torch.log_softmax(lg[0].float(), -1)[t] for lg, t in zip(ref.logits, tokens)])
    return tokens.tolist(), logp.cpu()


def engine_decode_vs_hf(dev: str) -> Result:
    model = tiny_model(5).to(dev).eval()
    outs = _engine_outputs(model, dev)
    atol = 1e-4 if dev == "cuda" else 1e-5
    bad, worst = [], 0.0
    for i, p in enumerate(PROMPTS):
        tokens, logp = _hf(model, p, dev)
        for toks, lp in outs[f"g{i}"]:
            if toks != tokens:
                bad.append(f"prompt {i}: engine {toks} vs HF {tokens}")
                continue
            worst = max(worst, float((lp - logp).abs().max()))
    if worst > atol:
        bad.append(f"logprob max |engine - HF| {worst:.2e} > {atol:g}")
    data = {"device": dev, "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS, "max_abs_logprob_diff": worst}
    detail = "; ".join(bad) or f"greedy tokens equal HF's; logprobs within {worst:.1e} (<= {atol:g})"
    return Result(not bad, detail, data)
