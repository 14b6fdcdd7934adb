"""models/context_limit.py: the context vLLM 0.32.0 and SGLang 0.5.23 derive from a model directory, each
expected value worked out by hand from the rules their sources state (cited in the module), and the caps the
supervisor starts servers with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_async.config import load_config
from areal_async.models.context_limit import capped, sglang_context, vllm_context
from areal_async.rollout.servers.vllm_server import max_model_len, vllm_argv
from areal_async.supervisor.servers import context_length, server_commands

ROOT = Path(__file__).resolve().parents[3]


def _model(tmp_path, config: dict, tokenizer: dict | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return tmp_path


@pytest.mark.parametrize(
    "config, tokenizer, vllm, sglang",
    [
        # SmolLM2-135M-Instruct's own: max_position_embeddings 8192, tokenizer model_max_length 1e30
        ({"max_position_embeddings": 8192}, {"model_max_length": 1e30}, (8192, "max_position_embeddings"), 8192),
        # vLLM takes the smallest key it knows (n_positions); SGLang the first of its list it finds (no n_positions)
        ({"max_position_embeddings": 4096, "n_positions": 2048}, None, (2048, "n_positions"), 4096),
        # the tokenizer's model_max_length bounds vLLM's, not SGLang's
        (
            {"max_position_embeddings": 4096},
            {"model_max_length": 1024},
            (1024, "tokenizer_config.json model_max_length"),
            4096,
        ),
        # a config model_max_length replaces vLLM's minimum (Cohere); SGLang reads it before max_position_embeddings
        ({"max_position_embeddings": 4096, "model_max_length": 8192}, None, (8192, "model_max_length"), 8192),
        # SGLang scales by a rope factor, except llama3 rope or one naming original_max_position_embeddings
        (
            {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
            None,
            (4096, "max_position_embeddings"),
            16384,
        ),
        (
            {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            None,
            (4096, "max_position_embeddings"),
            4096,
        ),
        (
            {
                "max_position_embeddings": 4096,
                "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 1024},
            },
            None,
            (4096, "max_position_embeddings"),
            4096,
        ),
        # a multimodal config: the text config's
        (
            {"text_config": {"max_position_embeddings": 2048}, "max_position_embeddings": 9999},
            None,
            (2048, "max_position_embeddings"),
            2048,
        ),
        # nothing known: vLLM unbounded, SGLang's default 2048
        ({"hidden_size": 8}, None, (None, ""), 2048),
    ],
)
def test_derived_contexts_by_hand(tmp_path, config, tokenizer, vllm, sglang):
    d = _model(tmp_path, config, tokenizer)
    assert vllm_context(d) == vllm
    assert sglang_context(d)[0] == sglang


def test_the_caps(tmp_path):
    d = _model(tmp_path, {"max_position_embeddings": 8192})
    assert capped(32768, d, "vllm") == capped(32768, d, "sglang") == 8192
    assert capped(4096, d, "vllm") == 4096
    assert capped(32768, None, "vllm") == 32768
    assert capped(32768, _model(tmp_path / "x", {}), "vllm") == 32768  # vLLM derives nothing: as configured


def test_servers_start_with_the_capped_context(tmp_path):
    """The issue's failure: model.path's max_position_embeddings 8192, vllm.max_model_len 32768 (the default)
    went to vLLM uncapped and vLLM refused to start. Now both servers get 8192."""
    d = _model(tmp_path / "m", {"max_position_embeddings": 8192})
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", [f"model.path={d}"])
    assert cfg.vllm.max_model_len == cfg.sglang.context_length == 32768
    assert max_model_len(cfg) == 8192
    argv = vllm_argv(cfg, d, "127.0.0.1", 1, 0)
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert context_length(cfg) == 8192
    sglang = load_config(ROOT / "configs/tiny_arith.yaml", [f"model.path={d}", "rollout.backend=sglang"])
    cmd = server_commands(sglang, tmp_path, ["http://127.0.0.1:9"])[0][1]
    assert cmd[cmd.index("--context-length") + 1] == "8192"
    tiny = load_config(ROOT / "configs/tiny_arith.yaml")  # the built model: its own positions
    assert max_model_len(tiny) == context_length(tiny) == tiny.model.max_position_embeddings
