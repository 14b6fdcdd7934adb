"""Metrics sinks: TensorBoard event files read back with TensorBoard's own reader; a failing sink
never costs a metrics.jsonl row; wandb refused clearly where it is not installed (test_wandb_sink.py runs
the real one)."""

import json
import sys

import pytest

from areal_async.config import from_dict
from areal_async.scheduler.runlog import RunLog
from areal_async.scheduler.sinks import StatsSink, sinks_from_config

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROWS = [
    {"kind": "eval", "step": 0, "version": 0, "eval_pass1": 0.25, "eval_pass1_ci_low": None, "wall_s": 1.5},
    {"step": 0, "version": 1, "reward_mean": 0.5, "staleness_max": 0, "loss": -0.125, "wall_s": 2.0},
    {
        "step": 1,
        "version": 2,
        "reward_mean": 0.75,
        "staleness_max": 1,
        "loss": 0.0625,
        "wall_s": 3.0,
        "note": "text is skipped",
    },
]


def test_tensorboard_events_hold_every_numeric_key_at_its_step(tmp_path):
    cfg = from_dict({}, ["stats_logger.tensorboard=true"])
    log = RunLog(tmp_path, dump_trajectories=False, sinks=sinks_from_config(cfg, tmp_path))
    for row in ROWS:
        log.metrics(row)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got == {
        "version": [(0, 0.0), (0, 1.0), (1, 2.0)],
        "eval_pass1": [(0, 0.25)],
        "wall_s": [(0, 1.5), (0, 2.0), (1, 3.0)],
        "reward_mean": [(0, 0.5), (1, 0.75)],
        "staleness_max": [(0, 0.0), (1, 1.0)],
        "loss": [(0, -0.125), (1, 0.0625)],
    }
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ROWS


class Broken(StatsSink):
    def __init__(self):
        self.calls = 0

    def log(self, row):
        self.calls += 1
        raise OSError("disk full")


def test_a_failing_sink_is_dropped_and_the_books_go_on(tmp_path, caplog):
    broken = Broken()
    log = RunLog(tmp_path, dump_trajectories=False, sinks=[broken])
    for row in ROWS:
        log.metrics(row)
    log.close()
    assert broken.calls == 1 and "metrics sink Broken failed" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_wandb_without_the_package_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import raises ImportError
    cfg = from_dict({}, ["stats_logger.wandb_project=recipe"])
    with pytest.raises(RuntimeError, match="stats_logger.wandb_project='recipe' needs the 'wandb' package"):
        sinks_from_config(cfg, tmp_path)
