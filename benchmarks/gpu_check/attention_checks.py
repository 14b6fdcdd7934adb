"""Which attention the trainer picks on this box, and that it computes what the dense-mask attention computes."""

from __future__ import annotations

import importlib.util

import torch
from transformers.utils import is_flash_attn_2_available

from areal_async.trainer.compute.packing import VARLEN_IMPL, forward_packed, pack, select_attn_implementation
from benchmarks.gpu_check.models import tiny_model
from benchmarks.gpu_check.registry import Result


def flash_attn_choice() -> Result:
    """The trainer's attention for bf16 compute on this box is flash-attn 2 exactly when transformers says it
    can run it (a bare ``flash_attn/cute`` of flash-attn-4 is not it), float32 never; and the chosen attention
    gives the dense block-causal mask's logprobs on a packed batch (bf16 on CUDA, float32 on CPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fa2 = bool(is_flash_attn_2_available())
    want = "flash_attention_2" if dev == "cuda" and fa2 else VARLEN_IMPL
    got = select_attn_implementation(dev, torch.bfloat16)
    fp32 = select_attn_implementation(dev, torch.float32)
    data = {
        "device": dev,
        "transformers_fa2": fa2,
        "find_spec_flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "chosen_bf16": got,
        "chosen_fp32": fp32,
    }
    if got != want or fp32 != VARLEN_IMPL:
        return Result(False, f"chose {got!r} (bf16) / {fp32!r} (fp32); expected {want!r} / {VARLEN_IMPL!r}", data)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    diff = _against_dense_mask(got, dev, dtype)
    data["max_abs_logp_diff"] = diff
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    ok = diff < tol
    return Result(ok, f"{got!r} for bf16; logprobs vs the dense mask: max |diff| {diff:.2e} (< {tol})", data)


def _against_dense_mask(impl: str, dev: str, dtype: torch.dtype) -> float:
    model = tiny_model(0).to(device=dev, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    packed = pack([torch.randint(1, 64, (n,), generator=gen) for n in (7, 19, 3, 12)])
    with torch.no_grad():
        model.set_attn_implementation(impl)
        chosen, _ = forward_packed(model, packed)
        model.set_attn_implementation("eager")
        dense, _ = forward_packed(model, packed)
    last = packed.cu_seqlens[1:] - 1  # a sequence's last position scores the next sequence: not compared
    keep = torch.ones(chosen.numel(), dtype=torch.bool)
    keep[last.long()] = False
    return float((chosen.float().cpu() - dense.float().cpu())[keep].abs().max())
