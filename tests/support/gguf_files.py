"""Small GGUF files written with the ``gguf`` package's own ``GGUFWriter`` (the writer llama.cpp's converters
use), for the importer's tests: a 1-layer Llama with a 13-token byte-level BPE (merges ``a b``, ``c d``) and
a chat template, float32 tensors named as llama.cpp names them (``token_embd``, ``blk.N.attn_q``, ...)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOKENS = ["<unk>", "<s>", "</s>", *"abcdefgh", "ab", "cd"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def write_tiny_gguf(path: Path, arch: str = "llama", hidden: int = 8, heads: int = 2, kv: int = 1, ff: int = 16):
    """A 1-layer model of ``arch`` (its tensors are Llama's whatever ``arch`` says), float32, seeded."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    hd = hidden // heads
    shapes = {
        "token_embd.weight": (len(TOKENS), hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (kv * hd, hidden),
        "blk.0.attn_v.weight": (kv * hd, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ff, hidden),
        "blk.0.ffn_up.weight": (ff, hidden),
        "blk.0.ffn_down.weight": (hidden, ff),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return shapes
