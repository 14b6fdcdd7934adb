"""The trainer's recording of every batch it trained (``rollout.dump_tensors``), for ``areal-async replay``
and ``mode: train_only``.

Layout, inside the run directory::

    recording/header.json              what bit-identity needs of the machine: torch version, thread
                                       count, deterministic-algorithms flag, device, ranks, dtype, CPU
    recording/step_000012.safetensors  one file per trained step (written atomically: temp file, rename)

A step file is safetensors (no pickle: it loads without running code) holding the step's trajectories,
in the order the step trained them, in the wire's one layout (``protocols.trajectories.TrajectoryBatch``:
each group's prompt once, outputs, behaviour logprobs, versions and the optional loss mask end to end,
in their one dtypes, with its ``score`` column: float64, the reward the scheduler planned, one per
trajectory), plus::

    rng_torch   uint8, torch's CPU RNG state just before the step

and string metadata: ``format``, ``step``, ``version`` (the version the step produced) and
``trajectory_meta`` (the layout's counts and ids, JSON). Reading back runs the wire's own checks
(``TrajectoryBatch.decode``); a file that is not this (truncated, another format, counts that do not
add up) raises ``RecordingError`` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from typing import Optional
from pathlib import Path
from typing import Sequence

import torch

from areal_async.base.private import private_dir
from areal_async.base.records import RECORDING_DIR, RECORDING_HEADER, recorded_steps
from protocols.messages import ProtocolError
from protocols.trajectories import Trajectory, TrajectoryBatch

__all__ = ["RECORDING_DIR", "Recorder", "RecordingError", "read_header", "read_step", "recorded_steps", "write_step"]

FORMAT = "areal-async-recording/2"
HEADER = RECORDING_HEADER
RNG_KEY = "rng_torch"


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


def machine_header(device: str, n_ranks: int, dtype: str, linears: Optional[str] = None) -> dict:
    """What must match for a replay to be bit-identical: written once per recording. ``linears``: the trainer's
    float32 CPU linears as it resolved ``actor.linears`` ("onednn" | "blas"; ``auto`` is a timing, so a replay
    takes the recorded choice instead of timing again)."""
    return ({"linears": linears} if linears else {}) | {
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


def encode_step(step: int, version: int, trajs: Sequence[Trajectory], rng_state: torch.Tensor):
    """(tensors, metadata) of one step's file."""
    if not trajs:
        raise ValueError("no trajectories to record")
    batch = TrajectoryBatch.of_samples(trajs)
    batch.columns.setdefault("score", torch.full((len(trajs),), float("nan"), dtype=torch.float64))
    _, tensors, layout = batch.encode()
    tensors = {name: t.cpu() for name, t in tensors.items()}
    tensors[RNG_KEY] = rng_state.detach().to(torch.uint8).reshape(-1).clone()
    meta = {"format": FORMAT, "step": str(step), "version": str(version), "trajectory_meta": json.dumps(layout)}
    return tensors, meta


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
    except RecordingError:
        raise
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


def _decode(path: Path, t: dict, meta: dict) -> RecordedStep:
    rng = t.pop(RNG_KEY)
    if "scores" in t:  # written before the one trajectory type: its score column's name, an int8 loss mask
        t["score"] = t.pop("scores")
        if "loss_mask" in t and t["loss_mask"].dtype == torch.int8:
            t["loss_mask"] = t["loss_mask"].bool()
    if "score" not in t:
        raise RecordingError(f"{path}: no score column; expected one float64 score a trajectory")
    try:
        rows = TrajectoryBatch.decode(path.name, json.loads(meta["trajectory_meta"]), t).samples()
        trajs = [r.scored(r.score) for r in rows]
    except ProtocolError as e:
        raise RecordingError(f"{path}: {e}") from None
    return RecordedStep(int(meta["step"]), int(meta["version"]), trajs, rng, path)


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
