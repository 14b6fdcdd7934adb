"""The context an inference server derives from a model directory, as vLLM and SGLang derive it.

A server started with a context longer than the one it derives from the model's ``config.json`` refuses to
start (unless an environment variable overrides it), an error no restart can fix. The supervisor starts
the servers with ``min(configured, derived)`` and the preflight refuses a run whose prompts + new tokens
cannot fit the derived context; both read it here, from the files, without importing either server.

- vLLM 0.32.0 (``vllm/transformers_utils/model_arch_config_convertor.py``
  ``derive_max_model_len_and_key``; ``vllm/config/model.py`` ``_get_and_verify_max_len``): the smallest of
  ``VLLM_KEYS`` present in the (text) config; ``model_max_length`` of the config, when set, replaces it;
  then at most the tokenizer_config's ``model_max_length``. A longer ``--max-model-len`` raises
  "User-specified max_model_len (...) is greater than the derived max_model_len (...)". Not mirrored:
  rope-scaling factors and sliding windows (the derived context is then larger, or smaller only when
  ``--disable-sliding-window`` is passed, which we never do): the cap here is never above vLLM's.
- SGLang 0.5.23 (``sglang/srt/utils/hf_transformers/common.py`` ``get_context_length``;
  ``sglang/srt/configs/model_config.py`` ``_derive_context_length``): the first of ``SGLANG_KEYS`` present,
  times the rope-scaling factor (1 for ``llama3`` rope or one with ``original_max_position_embeddings``),
  2048 when none is; a longer ``--context-length`` raises "User-specified context_length (...) is greater
  than the derived context_length (...)".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

VLLM_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
SGLANG_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
SGLANG_DEFAULT = 2048


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def text_config(model_dir: str | Path) -> dict:
    """config.json, or its ``text_config`` for a multimodal model ({} when unreadable)."""
    cfg = _json(Path(model_dir) / "config.json")
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def vllm_context(model_dir: str | Path) -> tuple[Optional[int], str]:
    """(the max_model_len vLLM derives, the key it comes from); (None, "") when nothing bounds it."""
    cfg = text_config(model_dir)
    found = [(int(cfg[k]), k) for k in VLLM_KEYS if isinstance(cfg.get(k), (int, float))]
    limit, key = min(found) if found else (None, "")
    if isinstance(cfg.get("model_max_length"), (int, float)) and cfg["model_max_length"]:
        limit, key = int(cfg["model_max_length"]), "model_max_length"
    tok_max = _json(Path(model_dir) / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok_max, (int, float)) and (limit is None or tok_max < limit):
        limit, key = int(tok_max), "tokenizer_config.json model_max_length"
    return limit, key


def sglang_context(model_dir: str | Path) -> tuple[int, str]:
    """(the context_length SGLang derives, the key it comes from)."""
    return sglang_rule(text_config(model_dir))


def sglang_rule(cfg: dict) -> tuple[int, str]:
    """SGLang's derivation from a (text) config as a dict."""
    rope = cfg.get("rope_scaling") or {}
    factor = (
        1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" else rope.get("factor", 1)
    )
    for key in SGLANG_KEYS:
        if cfg.get(key) is not None:
            return int(factor * cfg[key]), key
    return SGLANG_DEFAULT, "SGLang's default"


def capped(configured: int, model_dir: Optional[str | Path], backend: str) -> int:
    """``configured`` at most what ``backend`` ('vllm' or 'sglang') derives from ``model_dir`` (None: as is)."""
    if not model_dir:
        return configured
    limit = (vllm_context if backend == "vllm" else sglang_context)(model_dir)[0]
    return configured if limit is None else min(configured, limit)
