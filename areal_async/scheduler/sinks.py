"""Where metrics rows go besides ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

One small base (``StatsSink``: ``log(row)``, ``close()``) and two implementations, chosen by
``stats_logger.*``. Every numeric key of a row becomes a scalar named after the key: trainer-step
rows at ``step``; evaluation rows (``kind: eval``, from the periodic evaluator) at the policy
version they evaluated, which is the number of steps trained before it. Non-numeric values
(None, strings) are skipped.

TensorBoard events are written with the ``tensorboard`` package's own event writer and protos
(no torch, no TensorFlow: the scheduler process stays light). wandb logs each row with its
``step`` as the x-axis (``define_metric("*", step_metric="step")``), because evaluation rows
arrive just before the step row of the same version. Not covered: a resumed run's TensorBoard file
keeps the steps it logged after the checkpoint it resumed from (metrics.jsonl rolls them back).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path


class StatsSink(ABC):
    @abstractmethod
    def log(self, row: dict) -> None:
        """One metrics row (a dict with at least ``step``)."""

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Flush and release."""


def scalars(row: dict) -> dict[str, float]:
    """The numeric keys of a row (bools and the x-axis ``step`` left out)."""
    return {
        k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardSink(StatsSink):
    """Scalars into ``logdir/events.out.tfevents.*`` (read with ``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, logdir: str | Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:
            raise RuntimeError(
                f"stats_logger.tensorboard=true needs the 'tensorboard' package (pip install -e '.[tb]'): {e}"
            ) from None
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.writer = EventFileWriter(str(logdir))

    def log(self, row: dict) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars(row).items()]
        self.writer.add_event(
            self._event(wall_time=time.time(), step=int(row["step"]), summary=self._summary(value=values))
        )
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(StatsSink):
    """Rows to a Weights & Biases run (``wandb.init`` / ``wandb.log``); written against wandb's documented API."""

    def __init__(self, project: str, mode: str, name: str, run_dir: str | Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(f"stats_logger.wandb_project={project!r} needs the 'wandb' package installed") from None
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        self.run.log({"step": int(row["step"]), **scalars(row)})

    def close(self) -> None:
        self.run.finish()


def sinks_from_config(cfg, run_dir: str | Path) -> list[StatsSink]:
    """The sinks ``stats_logger.*`` asks for (an error naming the missing package if one cannot load)."""
    s, out = cfg.stats_logger, []
    if s.tensorboard:
        out.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
    if s.wandb_project:
        out.append(WandbSink(s.wandb_project, s.wandb_mode, cfg.experiment_name, run_dir, asdict(cfg)))
    return out
