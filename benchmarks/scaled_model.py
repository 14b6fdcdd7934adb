"""A larger model of the real preset's architecture, for memory at scale (issue 40: "a 0.5B model, same
architecture, random init is fine, fits the machine with both roles").

``python -m benchmarks.scaled_model OUT [--hidden 1152 --layers 32 --intermediate 3072 --heads 18 --kv-heads 6]``
writes an HF directory: SmolLM2-135M-Instruct's config (Llama, tied 49,152-row head, RoPE, its tokenizer and chat
template, copied from the imported checkpoint) with the widths and depth given, weights drawn by HF's own
initialisation (seeded), float32. The defaults keep SmolLM2's ratios (head dim 64, 3 query heads a KV head, MLP
8/3 of the hidden size): 0.51B parameters. It will not answer anything; it loads, generates, trains and
publishes at that size. Run the preset on it with ``model.path=OUT``."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from benchmarks.real_model import model_dir

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_scaled(
    out: Path,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    seed: int,
    src: Path | None = None,
) -> int:
    """The directory at ``out`` (the architecture, tokenizer and template of ``src``, by default the imported
    SmolLM2-135M-Instruct); returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = src or model_dir()
    raw = json.loads((src / "config.json").read_text())
    raw.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        _model_name_or_path=f"SmolLM2 architecture, random init, hidden {hidden} x {layers} layers",
    )
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden}, heads {heads}, kv heads {kv_heads}: heads must divide both")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in COPIED:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600; every role reads them
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=18)
    ap.add_argument("--kv-heads", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = write_scaled(a.out, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.seed)
    print(f"{a.out}: {n / 1e9:.3f}B parameters ({n * 4 / 1e9:.2f} GB float32)")


if __name__ == "__main__":
    main()
