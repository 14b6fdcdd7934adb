"""Synthetic payloads: Qwen2-shaped state dicts (weight sync) and boba-shaped trajectory batches."""

from __future__ import annotations

import numpy as np
import torch

MODELS = {  # name: (hidden, intermediate, layers, vocab, kv_heads, tied embeddings); Qwen2 shapes
    "tiny-0.6M": (128, 352, 2, 512, 2, False),
    "0.13B": (768, 2048, 12, 32000, 4, False),
    "0.5B": (896, 4864, 24, 151936, 2, True),  # Qwen2-0.5B: 494M
    "1.5B": (1536, 8960, 28, 151936, 2, True),  # Qwen2-1.5B / DeepSeek-R1-Distill-Qwen-1.5B: 1.54B
}


def synthetic_state_dict(
    hidden: int,
    inter: int,
    layers: int,
    vocab: int,
    kv_heads: int,
    tied: bool,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped state dict filled with cheap distinct constants (contents do not matter here)."""
    head = hidden // max(1, hidden // 128) if hidden >= 128 else hidden
    kv = kv_heads * head
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {
        n: torch.empty(s, dtype=dtype, device=device).fill_((i % 97) / 97) for i, (n, s) in enumerate(shapes.items())
    }


def lora_state_dict(
    shape: tuple, rank: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """A rank-``rank`` LoRA adapter on every linear layer of ``synthetic_state_dict(*shape)``'s model (q, k, v, o,
    gate, up, down; ``models.lora`` names): ``scale_model.lora_numel`` numbers."""
    out = {}
    for name, w in synthetic_state_dict(*shape, dtype, "meta").items():
        if name.endswith("_proj.weight"):
            layer = name.removesuffix(".weight")
            out[f"{layer}.lora_A.weight"] = torch.full((rank, w.shape[1]), 0.01, dtype=dtype, device=device)
            out[f"{layer}.lora_B.weight"] = torch.full((w.shape[0], rank), 0.02, dtype=dtype, device=device)
    return out


def nudge(sd: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Move ``fraction`` of each 16-bit tensor's elements by one unit in the last place (the lowest bit
    flipped), in place: a training step's change as a delta publication sees it (slime reports a few
    percent of the weights changing per step at conservative learning rates)."""
    g = torch.Generator().manual_seed(seed)
    for t in sd.values():
        bits = t.view(-1).view(torch.int16)
        idx = torch.randint(0, bits.numel(), (int(bits.numel() * fraction),), generator=g)
        bits[idx] ^= 1


def engine_shape(model: str) -> tuple:
    """``MODELS[model]`` with key/value heads that divide the attention heads, so a real model runs
    (the synthetic 0.13B has 6 heads and 4 kv heads: fine for shapes, not for attention)."""
    hidden, inter, layers, vocab, kv_heads, tied = MODELS[model]
    heads = max(1, hidden // 128)
    while heads % kv_heads:
        kv_heads -= 1
    return hidden, inter, layers, vocab, kv_heads, tied


def engine_model(shape: tuple, dtype: torch.dtype = torch.bfloat16):
    """A Qwen2 causal LM of ``shape`` (see ``synthetic_state_dict``), randomly initialised: its state
    dict has the synthetic one's names and shapes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, vocab, kv_heads, tied = shape
    heads = max(1, hidden // 128)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        max_position_embeddings=4096,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def n_params(model: str) -> int:
    """Parameters of the named synthetic model (shapes only, nothing allocated)."""
    return sum(t.numel() for t in synthetic_state_dict(*MODELS[model], device="meta").values())


def boba_batch(n_prompts: int, n_samples: int, max_len: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One dict per sequence: ids_T int32, logp_T float32, ver_T int32; lengths lognormal, capped."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(mean=np.log(4000), sigma=1.0, size=n_prompts * n_samples), max_len).astype(int)
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "ids_T": torch.randint(0, 151936, (n,), dtype=torch.int32, generator=g),
            "logp_T": -torch.rand(n, generator=g) * 5,
            "ver_T": torch.full((n,), 7, dtype=torch.int32),
        }
        for n in lens.clip(1)
    ]


def pack_batch(seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sequences concatenated, with ``cu_seqlens`` (int32, n + 1 offsets)."""
    lens = torch.tensor([len(s["ids_T"]) for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return {
        "ids_T": torch.cat([s["ids_T"] for s in seqs]),
        "logp_T": torch.cat([s["logp_T"] for s in seqs]),
        "ver_T": torch.cat([s["ver_T"] for s in seqs]),
        "cu_seqlens": cu,
    }


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
