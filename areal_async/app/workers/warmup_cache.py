"""Version 0 of a built policy, kept on disk: the SFT warm-up is computed once per everything that decides it.

The warm-up (``app/policy.warmup``) is deterministic: the same model config, seed, data, warm-up settings,
code, libraries and CPU give the same weights to the bit (two processes compared in
``tests/unit/app/test_warmup_cache.py``), and it leaves the global RNGs as it found them. It was most of
a short run's start-up (80 steps of the tiny preset: ~4 s of CPU on the trainer's path to its first
published weights). So its result is stored under ``$AREAL_ASYNC_CACHE/warmup/<key>/`` (default
``~/.cache/areal-async``), written to a temporary directory and renamed into place (as the BPE tokenizer
is, ``models/bpe.py``), and a later run with the same key loads it instead of training.

The key hashes: the ``model``, ``train_dataset`` and ``sft_warmup`` sections, the trainer's
``max_tokens_per_mb``, the seed, the dataset file's bytes (``type: jsonl``), the source of every module of
``areal_async`` (any edit is a new key), the Python, torch, transformers, tokenizers and reasoning-gym versions, torch's
threads, its CPU capability and the CPU's model name. What is covered: the built model (``model.path``
unset) on ``cluster.device: cpu``, up to ``MAX_CACHED_BYTES`` of weights; anything else trains every time.
``sft_warmup.cache: false`` turns it off. At most ``KEEP`` entries are kept (least recently used go first).

A hit restores what the warm-up leaves: the weights (``load_state_dict``, exact copies), the model in
training mode, and the per-step metrics it returned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import safetensors.torch
import tokenizers
import torch
import transformers

from areal_async.config import ExperimentConfig

KEY_VERSION = "warmup-1"  # bump when what a cache entry holds changes
MAX_CACHED_BYTES = 256 << 20
KEEP = 32
PACKAGE = Path(__file__).resolve().parents[2]  # areal_async/


def cache_root() -> Path:
    return Path(os.environ.get("AREAL_ASYNC_CACHE") or Path.home() / ".cache" / "areal-async") / "warmup"


def cacheable(cfg: ExperimentConfig, model: torch.nn.Module) -> bool:
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return cfg.sft_warmup.cache and not cfg.model.path and cfg.cluster.device == "cpu" and nbytes <= MAX_CACHED_BYTES


def cached_warmup(cfg: ExperimentConfig, model: torch.nn.Module, train: Callable[[], list[dict]]) -> list[dict]:
    """``train()`` (the warm-up, in place on ``model``) or its stored result; stores a new result."""
    if not cacheable(cfg, model):
        return train()
    entry = cache_root() / warmup_key(cfg)
    metrics = _load(entry, model)
    if metrics is not None:
        return metrics
    shutil.rmtree(entry, ignore_errors=True)  # an entry that would not load (cut short, corrupt): replaced
    metrics = train()
    _store(entry, model, metrics)
    return metrics


def warmup_key(cfg: ExperimentConfig) -> str:
    """A hash of everything the warm-up's result depends on (the module docstring lists it)."""
    h = hashlib.sha256()
    parts = {
        "version": KEY_VERSION,
        "model": dataclasses.asdict(cfg.model),
        "data": dataclasses.asdict(cfg.train_dataset),
        "sft": dataclasses.asdict(cfg.sft_warmup) | {"cache": None},
        "max_tokens_per_mb": cfg.actor.mb_spec.max_tokens_per_mb,
        "seed": cfg.seed,
        "libs": [sys.version, torch.__version__, transformers.__version__, tokenizers.__version__, _gym_version()],
        "cpu": [torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), platform.machine(), _cpu_model()],
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    if cfg.train_dataset.type == "jsonl" and cfg.train_dataset.path:
        h.update(Path(cfg.train_dataset.path).read_bytes())
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def _gym_version() -> Optional[str]:
    """reasoning-gym's version (it generates ``type: reasoning_gym`` datasets); None when not installed."""
    try:
        return importlib.metadata.version("reasoning_gym")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())


def _load(entry: Path, model: torch.nn.Module) -> Optional[list[dict]]:
    """The stored metrics after loading the stored weights into ``model``; None (model untouched) on a miss."""
    try:
        metrics = json.loads((entry / "metrics.json").read_text())
        state = safetensors.torch.load_file(entry / "model.safetensors")
    except (OSError, ValueError, safetensors.SafetensorError):
        return None
    own = model.state_dict()
    if state.keys() != own.keys() or any(state[k].shape != own[k].shape or state[k].dtype != own[k].dtype for k in own):
        return None
    model.load_state_dict(state)
    model.train()  # as the warm-up's steps leave it
    os.utime(entry)  # recently used: kept by the pruning
    return metrics


def _store(entry: Path, model: torch.nn.Module, metrics: list[dict]) -> None:
    """Write the entry atomically (a temporary directory renamed); another writer's entry wins a race."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # clone: tied weights save too
        safetensors.torch.save_file(state, tmp / "model.safetensors")
        (tmp / "metrics.json").write_text(json.dumps(metrics))
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # the run goes on; the next one trains again
        return
    _prune(entry.parent)


def _prune(root: Path, keep: int = KEEP) -> None:
    entries = sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".*"):  # a writer that died mid-write, an hour ago or more
        if time.time() - _mtime(tmp) > 3600:
            shutil.rmtree(tmp, ignore_errors=True)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
