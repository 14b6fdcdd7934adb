"""benchmarks/memory.py's formulas and rows (the measurement itself runs in ``python -m benchmarks.memory``)."""

import torch
import transformers

from benchmarks.memory import R1_1P5B, logits_term, predict_boba, r1_params, ratio_rows


def test_r1_parameter_count_matches_the_hf_model_built_on_meta():
    m = dict(R1_1P5B, layers=2)  # the per-layer count checked at 2 layers (28 build slowly even on meta)
    cfg = transformers.Qwen2Config(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    assert r1_params(m) == sum(p.numel() for p in model.parameters())
    assert r1_params() == 1_777_088_000  # DeepSeek-R1-Distill-Qwen-1.5B: 1.78 B as published


def test_logits_term_by_hand():
    assert logits_term(4096, 151936, 0, 64) == 5 * 4096 * 151936 * 4  # 12.4 GB
    assert logits_term(4096, 151936, 1024, 64) == 3 * 1024 * 151936 * 4 + 151936 * 64 * 4
    assert logits_term(512, 151936, 1024, 64) == 5 * 512 * 151936 * 4  # one chunk: the whole path


def test_ratio_rows_pair_chunked_with_whole_of_the_same_case():
    rows = [
        dict(vocab=7, tokens=8, ckpt=False, chunk=0, value=100),
        dict(vocab=7, tokens=8, ckpt=False, chunk=4, value=20),
        dict(vocab=7, tokens=8, ckpt=True, chunk=4, value=10),  # no whole run with ckpt: no ratio
    ]
    (r,) = ratio_rows(rows, 4)
    assert (r["metric"], r["value"], r["ckpt"]) == ("trainer_peak_ratio_chunked_vs_whole", 0.2, False)


def test_boba_prediction_sums_its_terms():
    rows = predict_boba()
    assert {(r["chunk"], r["ckpt"]) for r in rows} == {(0, False), (1024, False), (0, True), (1024, True)}
    for r in rows:
        assert r["value"] == r["state_bytes"] + r["gathered_bytes"] + r["activation_bytes"] + r["logits_bytes"]
        assert r["state_bytes"] == 16 * 1_777_088_000 // 4
