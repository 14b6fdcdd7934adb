"""The trainer's recording of every batch it trained (``rollout.dump_tensors``), for ``areal-async replay``
and ``mode: train_only``.

Layout, inside the run directory::

    recording/header.json              what bit-identity needs of the machine: torch version, thread
                                       count, deterministic-algorithms flag, device, ranks, dtype, CPU
    recording/step_000012.safetensors  one file per trained step (written atomically: temp file, rename)

A step file is safetensors (no pickle: it loads without running code) holding the step's trajectories,
in the order the step trained them, in the wire's one layout (``protocols.trajectories.TrajectoryBatch``:
each group's prompt once, outputs, behaviour logprobs, versions and the optional loss mask end to end,
in their wire dtypes) plus::

    scores      float64, the reward the scheduler planned, one per trajectory
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
from pathlib import Path
from typing import Sequence

import torch

from protocols.messages import ProtocolError
from protocols.trajectories import TrajectoryBatch

from areal_async.base.private import private_dir
from areal_async.base.records import RECORDING_DIR, RECORDING_HEADER, recorded_steps
from areal_async.trainer.types import Trajectory

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


def _runs(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Consecutive trajectories of one group with one prompt (the layout keeps a group's prompt once)."""
    runs: list[list[Trajectory]] = []
    for t in trajs:
        last = runs[-1][-1] if runs else None
        same = last is not None and last.group_id == t.group_id and torch.equal(last.prompt_ids, t.prompt_ids)
        if same:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _as_batch(trajs: Sequence[Trajectory]) -> TrajectoryBatch:
    """The trajectories in the wire layout (a loss mask on none, or on all: all ones where one had none)."""
    masked = any(t.loss_mask is not None for t in trajs)

    def mask(t: Trajectory):
        return None if not masked else torch.ones(t.output_ids.numel()) if t.loss_mask is None else t.loss_mask

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.reshape(-1).cpu() for p in parts])

    return TrajectoryBatch.join(
        [
            TrajectoryBatch.group(
                run[0].group_id,
                [t.sample_id for t in run],
                run[0].prompt_ids.cpu(),
                [t.output_ids.numel() for t in run],
                cat([t.output_ids for t in run]),
                cat([t.behav_logp for t in run]),
                cat([t.versions for t in run]),
                loss_mask=cat([mask(t) for t in run]) if masked else None,
                segment_starts=[list(t.segment_starts or []) for t in run],
            )
            for run in _runs(trajs)
        ]
    )


def encode_step(step: int, version: int, trajs: Sequence[Trajectory], rng_state: torch.Tensor):
    """(tensors, metadata) of one step's file."""
    if not trajs:
        raise ValueError("no trajectories to record")
    _, tensors, layout = _as_batch(trajs).encode()
    tensors = dict(tensors)
    tensors["scores"] = torch.tensor([float(x.score) for x in trajs], dtype=torch.float64)
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
    scores, rng = t.pop("scores"), t.pop(RNG_KEY)
    try:
        views = TrajectoryBatch.decode(path.name, json.loads(meta["trajectory_meta"]), t).samples()
    except ProtocolError as e:
        raise RecordingError(f"{path}: {e}") from None
    if scores.dtype != torch.float64 or scores.numel() != len(views):
        raise RecordingError(f"{path}: {scores.numel()} {scores.dtype} scores for {len(views)} trajectories")
    trajs = [Trajectory.of(v, s) for v, s in zip(views, scores.tolist())]
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
