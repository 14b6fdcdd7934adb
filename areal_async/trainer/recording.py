"""The trainer's recording of every batch it trained (``rollout.dump_tensors``), for ``areal-async replay``
and ``mode: train_only``.

Layout, inside the run directory::

    recording/header.json              what bit-identity needs of the machine: torch version, thread
                                       count, deterministic-algorithms flag, device, ranks, dtype, CPU
    recording/step_000012.safetensors  one file per trained step (written atomically: temp file, rename)

A step file is safetensors (no pickle: it loads without running code), tensors laid end to end in
the order the step trained its trajectories::

    prompt_ids, prompt_lengths      int32/int64 ids, int64 one length per trajectory
    output_ids, output_lengths      idem (output_lengths: one per trajectory)
    behav_logp                      float32, one per output token (the rollouts' behaviour logprobs)
    versions                        int32/int64, policy version of each output token
    loss_mask, has_mask             uint8 per output token and per trajectory (only when a mask was set)
    scores                          float64, the reward the scheduler planned per trajectory
    rng_torch                       uint8, torch's CPU RNG state just before the step

and string metadata: ``format``, ``step``, ``version`` (the version the step produced),
``sample_ids`` and ``group_ids`` (JSON lists). A file that is not this (truncated, another format,
lengths that do not add up) raises ``RecordingError`` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from areal_async.base.private import private_dir
from areal_async.base.records import RECORDING_DIR, RECORDING_HEADER, recorded_steps
from areal_async.trainer.types import Trajectory

__all__ = ["RECORDING_DIR", "Recorder", "RecordingError", "read_header", "read_step", "recorded_steps", "write_step"]

FORMAT = "areal-async-recording/1"
HEADER = RECORDING_HEADER
RNG_KEY = "rng_torch"
_INT = (torch.int32, torch.int64)


class RecordingError(ValueError):
    """A recording that cannot be read back as written (the message names the file and the fault)."""


@dataclass
class RecordedStep:
    """One trained step read back: its trajectories in training order and the RNG state before it."""

    step: int
    version: int
    trajs: list[Trajectory]
    rng_state: torch.Tensor
    path: Path


def recording_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / RECORDING_DIR


def step_path(run_dir: str | Path, step: int) -> Path:
    return recording_dir(run_dir) / f"step_{step:06d}.safetensors"


def machine_header(device: str, n_ranks: int, dtype: str) -> dict:
    """What must match for a replay to be bit-identical: written once per recording."""
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "device": device,
        "n_trainer_ranks": n_ranks,
        "dtype": dtype,
        "machine": platform.machine(),
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def read_header(run_dir: str | Path) -> dict:
    path = recording_dir(run_dir) / HEADER
    try:
        header = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordingError(f"{path}: no recording header; expected a run with rollout.dump_tensors=true") from None
    except (OSError, ValueError) as e:
        raise RecordingError(f"{path}: unreadable recording header ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RecordingError(f"{path}: format {_get(header, 'format')!r}; expected {FORMAT!r}")
    return header


def _get(d, key):
    return d.get(key) if isinstance(d, dict) else None


def _cat(parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if not parts:
        raise ValueError(f"no {what} to record")
    return torch.cat([p.reshape(-1).cpu() for p in parts])


def encode_step(step: int, version: int, trajs: Sequence[Trajectory], rng_state: torch.Tensor):
    """(tensors, metadata) of one step's file."""
    t = {
        "prompt_ids": _cat([x.prompt_ids for x in trajs], "prompts"),
        "prompt_lengths": torch.tensor([x.prompt_ids.numel() for x in trajs], dtype=torch.int64),
        "output_ids": _cat([x.output_ids for x in trajs], "outputs"),
        "output_lengths": torch.tensor([x.output_ids.numel() for x in trajs], dtype=torch.int64),
        "behav_logp": _cat([x.behav_logp for x in trajs], "logprobs"),
        "versions": _cat([x.versions for x in trajs], "versions"),
        "scores": torch.tensor([float(x.score) for x in trajs], dtype=torch.float64),
        RNG_KEY: rng_state.detach().to(torch.uint8).reshape(-1).clone(),
    }
    if any(x.loss_mask is not None for x in trajs):
        ones = [torch.ones(x.output_ids.numel(), dtype=torch.bool) for x in trajs]
        masks = [o if x.loss_mask is None else x.loss_mask for o, x in zip(ones, trajs)]
        t["loss_mask"] = _cat(masks, "loss masks").to(torch.uint8)
        t["has_mask"] = torch.tensor([x.loss_mask is not None for x in trajs], dtype=torch.uint8)
    meta = {
        "format": FORMAT,
        "step": str(step),
        "version": str(version),
        "sample_ids": json.dumps([x.sample_id for x in trajs]),
        "group_ids": json.dumps([x.group_id for x in trajs]),
    }
    return t, meta


def write_step(
    run_dir: str | Path, step: int, version: int, trajs: Sequence[Trajectory], rng_state: torch.Tensor
) -> int:
    """Write one step's file atomically; its size in bytes."""
    from safetensors.torch import save_file

    tensors, meta = encode_step(step, version, trajs, rng_state)
    path = step_path(run_dir, step)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path.stat().st_size


def read_step(path: str | Path) -> RecordedStep:
    """One step file back as trajectories; ``RecordingError`` for anything but a well-formed file."""
    path = Path(path)
    tensors, meta = _load(path)
    try:
        return _decode(path, tensors, meta)
    except (KeyError, ValueError, TypeError) as e:
        raise RecordingError(f"{path}: not a well-formed recorded step ({type(e).__name__}: {e})") from None


def _load(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    if not path.is_file():
        raise RecordingError(f"{path}: no such recorded step")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a truncated or garbled file
        raise RecordingError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise RecordingError(f"{path}: format {meta.get('format')!r}; expected {FORMAT!r}")
    return tensors, meta


def _split(t: torch.Tensor, lengths: list[int], name: str, path: Path) -> list[torch.Tensor]:
    if t.numel() != sum(lengths):
        raise RecordingError(f"{path}: {name} has {t.numel()} entries; the lengths add up to {sum(lengths)}")
    return list(t.split(lengths))


def _decode(path: Path, t: dict, meta: dict) -> RecordedStep:
    sids, gids = json.loads(meta["sample_ids"]), json.loads(meta["group_ids"])
    plens, olens = t["prompt_lengths"].tolist(), t["output_lengths"].tolist()
    if not (len(sids) == len(gids) == len(plens) == len(olens) == t["scores"].numel()) or not sids:
        raise RecordingError(
            f"{path}: {len(sids)} sample ids, {len(gids)} group ids, {len(plens)} prompt lengths, {len(olens)} "
            f"output lengths, {t['scores'].numel()} scores; expected as many of each, at least one"
        )
    for name in ("prompt_ids", "output_ids", "versions"):
        if t[name].dtype not in _INT:
            raise RecordingError(f"{path}: {name} is {t[name].dtype}; expected int32 or int64")
    if t["behav_logp"].dtype != torch.float32:
        raise RecordingError(f"{path}: behav_logp is {t['behav_logp'].dtype}; expected float32")
    cols = [_split(t["prompt_ids"], plens, "prompt_ids", path)]
    cols += [_split(t[n], olens, n, path) for n in ("output_ids", "behav_logp", "versions")]
    masks = _masks(path, t, olens)
    scores = t["scores"].tolist()
    trajs = [
        Trajectory(sid, gid, p, o, lp, v, s, m) for sid, gid, p, o, lp, v, s, m in zip(sids, gids, *cols, scores, masks)
    ]
    return RecordedStep(int(meta["step"]), int(meta["version"]), trajs, t[RNG_KEY], path)


def _masks(path: Path, t: dict, olens: list[int]) -> list[Optional[torch.Tensor]]:
    if "loss_mask" not in t:
        return [None] * len(olens)
    has = t["has_mask"].tolist()
    if len(has) != len(olens):
        raise RecordingError(f"{path}: has_mask has {len(has)} entries for {len(olens)} trajectories")
    parts = _split(t["loss_mask"].to(torch.bool), olens, "loss_mask", path)
    return [m if h else None for m, h in zip(parts, has)]


class Recorder:
    """Writes ``recording/`` for one trainer, from ``start_step`` on (a resumed trainer first removes the
    files of steps it will train again: the crashed attempt's)."""

    def __init__(self, run_dir: str | Path, start_step: int, header: dict):
        self.run_dir = Path(run_dir)
        d = private_dir(recording_dir(run_dir))  # 0700 as the run directory: prompts and outputs of the run
        for step in recorded_steps(run_dir):
            if step >= start_step:
                step_path(run_dir, step).unlink()
        (d / HEADER).write_text(json.dumps(header, indent=1, sort_keys=True))
        self.bytes_written = 0

    def rng_state(self) -> torch.Tensor:
        """Taken just before a step: replay restores it, so a step that draws random numbers (dropout) repeats."""
        return torch.get_rng_state()

    def step(self, step: int, version: int, trajs: Sequence[Trajectory], rng_state: torch.Tensor) -> int:
        n = write_step(self.run_dir, step, version, trajs, rng_state)
        self.bytes_written += n
        return n
