"""``areal-async replay RUN_DIR --steps A:B``: the trainer alone, again, on what it trained.

Steps are counted as in metrics.jsonl (step k produces version k + 1) and ``A:B`` is a half-open range
like a Python slice: steps A .. B-1 are trained, from the run's checkpoint of version A (saved after step
A-1) to version B, and the weights are compared with the run's checkpoint of version B (saved after step
B-1). With ``saver.freq_steps=10``, ``--steps 10:20`` starts from ``checkpoints/step_9`` and ends at
``checkpoints/step_19``.

The actor is built exactly as a resumed trainer builds it (``trainer_worker.make_actor`` + ``restore_actor``:
the checkpoint's fp32 master weights and optimizer from its DCP shards, its lr schedule and step), each
step's recorded batch is trained in its recorded order after restoring the torch RNG state recorded just
before it, on the thread count the recording names. Then every tensor of the model's state dict and of the
optimizer state is compared bit for bit with the checkpoint's (SHA-256 over names, dtypes, shapes and
bytes): identical = exit 0; else exit 1 naming the first tensor that differs.

What it needs to be bit-identical (docs/replay.md): one unsharded trainer rank (the recording's
``n_trainer_ranks`` 1, float32), the same torch build and CPU kind, the same thread count.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from areal_async.app.workers.trainer_worker import make_actor, restore_actor
from areal_async.base.process import set_torch_threads
from areal_async.config import ExperimentConfig, load_config
from areal_async.models.lean_ops import onednn_usable
from areal_async.models.tiny import load_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.persist.checkpoint import load_checkpoint
from areal_async.trainer.persist.checkpoint_dirs import COMPLETE
from areal_async.trainer.compute.dp import DataParallel
from areal_async.trainer.persist.recording import (
    RecordedStep,
    RecordingError,
    machine_header,
    read_header,
    read_step,
    step_path,
)

log = logging.getLogger("areal_async.replay")


class ReplayError(ValueError):
    """A replay that cannot start (missing checkpoint or recording, a run it cannot reproduce): exit 2."""


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B`` (0 <= A < B) -> (A, B)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ReplayError(
            f"--steps {text!r}: expected A:B, two integers (steps A .. B-1, as in metrics.jsonl)"
        ) from None
    if not 0 <= a < b:
        raise ReplayError(f"--steps {text!r}: expected 0 <= A < B")
    return a, b


def checkpoint_of_version(run_dir: str | Path, version: int) -> Optional[Path]:
    """The run's complete checkpoint holding policy version ``version`` (None: there is none)."""
    for d in sorted((Path(run_dir) / "checkpoints").glob("step_*")):
        if (d / COMPLETE).is_file() and load_checkpoint(d)["version"] == version:
            return d
    return None


def build_actor(cfg: ExperimentConfig, ckpt_dir: Path) -> PPOActor:
    """The actor as a trainer resumed from ``ckpt_dir`` has it (the RNG states restored too)."""
    ckpt = load_checkpoint(ckpt_dir, restore_rng=True)
    model = load_model(ckpt_dir, cfg.model.dtype)
    actor = make_actor(cfg, model, load_tokenizer(ckpt_dir), DataParallel.single(), sharded=False)
    restore_actor(actor, ckpt)
    return actor


def train_recorded(actor: PPOActor, rec: RecordedStep) -> dict[str, float]:
    """One recorded step, as the run trained it: its RNG state first, then its batch in its order."""
    if actor.step != rec.step:
        raise ReplayError(f"{rec.path}: recorded step {rec.step}, but the actor is at step {actor.step}")
    torch.set_rng_state(rec.rng_state)
    return actor.train_step(rec.trajs)


def state_tensors(actor: PPOActor) -> dict[str, torch.Tensor]:
    """The model's state dict, then each parameter's optimizer state as ``optimizer.<param>.<key>``."""
    out = {k: v.detach() for k, v in actor.model.state_dict().items()}
    for name, p in actor.model.named_parameters():
        for key, v in sorted(actor.optimizer.state.get(p, {}).items()):
            out[f"optimizer.{name}.{key}"] = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bitwise comparison: -0.0 != 0.0, NaN == same NaN)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(_SAME_SIZE_INT[t.element_size()]) if t.dtype != torch.bool else t


def tensor_digest(name: str, t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(_bytes(t))
    return h.hexdigest()


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) in the dict's order."""
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(tensor_digest(name, t).encode())
    return h.hexdigest()


def first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> Optional[str]:
    """The first tensor (in ``want``'s order) that differs in bits, dtype or shape, or is on one side only,
    with how; None when all are identical."""
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return f"{name} (in the checkpoint, not in the replay)"
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name} ({g.dtype} {tuple(g.shape)} replayed, {w.dtype} {tuple(w.shape)} in the checkpoint)"
        if _bytes(g) != _bytes(w):
            bits = _as_bits(g) != _as_bits(w)
            diff = float((g.double().cpu() - w.double().cpu()).abs().max())
            return f"{name} ({int(bits.sum())} of {w.numel()} elements differ in bits, max |diff| {diff:.3g})"
    extra = [n for n in got if n not in want]
    return f"{extra[0]} (in the replay, not in the checkpoint)" if extra else None


@dataclass
class ReplayReport:
    steps: tuple[int, int]
    start: Path
    end: Path
    replayed_sha256: str = ""
    checkpoint_sha256: str = ""
    first_diff: Optional[str] = None
    n_tensors: int = 0
    losses: list[float] = field(default_factory=list)
    run_losses: list[Optional[float]] = field(default_factory=list)  # metrics.jsonl's, None where it has none
    warnings: list[str] = field(default_factory=list)

    @property
    def first_loss_diff(self) -> Optional[int]:
        """The first step whose loss (computed on the step's starting weights) differs from the run's: the
        weights or the batch already differed there."""
        pairs = zip(range(*self.steps), self.losses, self.run_losses)
        return next((s for s, mine, run in pairs if run is not None and mine != run), None)

    @property
    def identical(self) -> bool:
        return self.first_diff is None


def _machine_warnings(header: dict) -> list[str]:
    """What differs from the machine that recorded (each may break bit-identity)."""
    here = machine_header(header.get("device", "cpu"), 1, "float32")
    keys = ("torch", "torch_threads", "deterministic_algorithms", "machine", "cpu")
    return [f"{k}: recorded {header.get(k)!r}, here {here[k]!r}" for k in keys if header.get(k) != here[k]]


def _check_reproducible(run_dir: Path, header: dict) -> None:
    if header.get("n_trainer_ranks") != 1 or header.get("dtype") != "float32":
        raise ReplayError(
            f"{run_dir}: recorded by {header.get('n_trainer_ranks')} trainer rank(s) in {header.get('dtype')}; replay "
            "runs one unsharded float32 rank and is bit-identical only to such a run (docs/replay.md)"
        )


def _recorded_linears(run_dir: Path, header: dict) -> list[str]:
    """The config override that runs the recorded linears (a recording from before the header kept them: none)."""
    linears = header.get("linears")
    if linears is None:
        return []
    if linears not in ("onednn", "blas"):
        raise ReplayError(f"{run_dir}/recording/header.json: linears {linears!r} is not 'onednn' or 'blas'")
    if linears == "onednn" and not onednn_usable(torch.empty(0)):
        raise ReplayError(f"{run_dir}: recorded with the trainer's linears on oneDNN; this torch has no oneDNN matmul")
    return [f"actor.linears={linears}"]


def _ends(run_dir: Path, a: int, b: int) -> tuple[Path, Path]:
    start, end = checkpoint_of_version(run_dir, a), checkpoint_of_version(run_dir, b)
    for v, p, after in ((a, start, a - 1), (b, end, b - 1)):
        if p is None:
            raise ReplayError(
                f"{run_dir}/checkpoints: no complete checkpoint of version {v} (saved after step {after}); "
                "choose A and B where the run saved (saver.freq_steps, saver.keep_last)"
            )
    missing = [s for s in range(a, b) if not step_path(run_dir, s).is_file()]
    if missing:
        raise ReplayError(f"{run_dir}/recording: steps {missing[:5]} are not recorded; expected steps {a}..{b - 1}")
    return start, end


def run_losses(run_dir: Path) -> dict[int, float]:
    """Step -> the loss the run logged (metrics.jsonl; a step logged twice, by a resumed run: the last)."""
    out = {}
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if row.get("kind") != "eval" and isinstance(row.get("loss"), float):
            out[int(row["step"])] = row["loss"]
    return out


def replay(run_dir: str | Path, a: int, b: int, on_step=None) -> ReplayReport:
    """Train steps a..b-1 again from the run's checkpoint of version a; compare with its checkpoint of
    version b. ``on_step(step, metrics, the run's loss or None)``: called after each step."""
    run_dir = Path(run_dir)
    header = read_header(run_dir)
    _check_reproducible(run_dir, header)
    start, end = _ends(run_dir, a, b)
    cfg = load_config(run_dir / "config.yaml", _recorded_linears(run_dir, header))
    set_torch_threads(int(header["torch_threads"]))
    rep = ReplayReport((a, b), start, end, warnings=_machine_warnings(header))
    actor, logged = build_actor(cfg, start), run_losses(run_dir)
    for s in range(a, b):
        m = train_recorded(actor, read_step(step_path(run_dir, s)))
        rep.losses.append(float(m["loss"]))
        rep.run_losses.append(logged.get(s))
        if on_step is not None:
            on_step(s, m, logged.get(s))
    got = state_tensors(actor)
    want = state_tensors(build_actor(cfg, end))
    rep.n_tensors = len(want)
    rep.replayed_sha256, rep.checkpoint_sha256 = state_digest(got), state_digest(want)
    rep.first_diff = first_difference(got, want)
    return rep


__all__ = ["ReplayError", "RecordingError", "replay", "parse_steps", "ReplayReport"]
