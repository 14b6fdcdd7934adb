"""Atomic, resumable checkpoints: ``root/step_<k>/`` with a ``COMPLETE`` marker written last.

Layout of one checkpoint (the directory itself loads with ``AutoModelForCausalLM.from_pretrained``):
    config.json, model.safetensors, generation_config.json   model (HF safetensors)
    tokenizer files                                          when a tokenizer is given
    dcp/               RL trainer: model (fp32 master) + optimizer as DCP shards (sharded_ckpt.py)
    actor_state.pt     lr scheduler + step (+ optimizer when there is no dcp/) (torch.save; weights_only)
    rng.pt             python / numpy / torch (/ cuda) RNG   (torch.save; loads weights_only)
    extra.json         caller's state: scheduler ledger, dataset cursor ...
    meta.json          step, policy version, wall time
    COMPLETE           written and fsynced last

Atomicity: everything is written into ``root/.tmp-step_<k>-<pid>/``, fsynced, ``COMPLETE`` is
added, then the directory is renamed to ``step_<k>`` (rename is atomic on one filesystem) and
``root`` is fsynced. ``checkpoint_dirs.latest_complete_checkpoint`` only considers ``step_<k>`` directories that
hold ``COMPLETE``, so a crash at any point leaves the previous checkpoint as the latest.

Assumes one writer per root (the trainer's rank 0; the other ranks write only their DCP shards
into the temp directory rank 0 names, inside ``write_model``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from areal_async.base.private import private_dir
from areal_async.trainer.persist.checkpoint_dirs import COMPLETE


# --------------------------------------------------------------------------------------------
# RNG states (as plain tensors/ints so that torch.load(weights_only=True) accepts them)
# --------------------------------------------------------------------------------------------


def rng_states() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(_as_tuples(states["python"]))
    n = states["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuples(x: Any) -> Any:
    """random.setstate wants tuples; a serializer may hand back lists."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            _fsync_path(p)
    _fsync_path(path)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))


def _write_payload(
    tmp: Path,
    step: int,
    version: int,
    model,
    tokenizer,
    actor_state: dict,
    extra: dict,
    write_model: Optional[Callable[[Path], None]],
) -> None:
    if write_model is not None:
        write_model(tmp)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(actor_state, tmp / "actor_state.pt")
    torch.save(rng_states(), tmp / "rng.pt")
    _write_json(tmp / "extra.json", extra)
    _write_json(tmp / "meta.json", {"step": step, "version": version, "time": time.time()})


def _mark_complete(tmp: Path) -> None:
    _fsync_tree(tmp)  # the payload is on disk before the marker can be
    with open(tmp / COMPLETE, "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(tmp)


def save_checkpoint(
    root: str | Path,
    step: int,
    version: int,
    model,
    tokenizer,
    actor_state: dict,
    extra: dict,
    write_model: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write ``root/step_<step>`` atomically and return its path (replaces an existing one).

    ``write_model(tmp_dir)`` replaces ``model.save_pretrained`` (the trainer's ranks write DCP
    shards and the gathered HF export there: ``sharded_ckpt.py``)."""
    if step < 0:
        raise ValueError(f"step={step}: expected an integer >= 0")
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"extra must be JSON-serializable (scheduler ledger, dataset cursor ...): {e}") from e
    root = private_dir(root)  # 0700: a checkpoint's DCP metadata is a pickle (base/private.py)
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save by a previous process
    tmp.mkdir(mode=0o700)
    _write_payload(tmp, step, version, model, tokenizer, actor_state, extra, write_model)
    _mark_complete(tmp)
    _replace_dir(tmp, final)
    _fsync_path(root)
    return final


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():  # re-saving a step: move the old one aside first; never two half states
        trash = dst.with_name(f".trash-{dst.name}-{os.getpid()}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(dst, trash)
        os.rename(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(src, dst)


# --------------------------------------------------------------------------------------------
# loading (finding and pruning: checkpoint_dirs)
# --------------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path, restore_rng: bool = False, map_location: str = "cpu") -> dict:
    """The checkpoint's state: path, step, version, actor_state, extra, rng (and optionally
    restores the RNGs). Weights load separately: ``AutoModelForCausalLM.from_pretrained(path)``."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise ValueError(
            f"checkpoint {str(path)!r} has no {COMPLETE} marker; expected a complete checkpoint "
            "(use latest_complete_checkpoint(root))"
        )
    meta = json.loads((path / "meta.json").read_text())
    rng = torch.load(path / "rng.pt", weights_only=True)
    if restore_rng:
        restore_rng_states(rng)
    return {
        "path": path,
        "step": meta["step"],
        "version": meta["version"],
        "actor_state": torch.load(path / "actor_state.pt", map_location=map_location, weights_only=True),
        "extra": json.loads((path / "extra.json").read_text()),
        "rng": rng,
    }
