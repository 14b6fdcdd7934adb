"""The Python API: a real fleet started, streamed and stopped from Python (sync and async forms)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import areal_async
from areal_async import Fleet, FleetError, load_config

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "total_train_steps=4",
    "sft_warmup.steps=10",
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "cluster.heartbeat_s=0.5",
]


@pytest.mark.slow
def test_fleet_runs_streams_and_writes_the_cli_summary(tmp_path):
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", FAST)
    fleet = Fleet(cfg, run_dir=tmp_path / "run")
    with pytest.raises(FleetError, match="not started"):
        fleet.wait()
    with fleet:
        rows = list(fleet.metrics(poll_s=0.1))  # ends when the run ends
        assert fleet.wait(timeout=60) == 0
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    summary = fleet.summary()
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())  # what the CLI prints and leaves
    assert summary == on_disk and summary["steps"] == 4 and summary["samples_lost"] == 0
    assert summary["samples_trained"] == 4 * 4 * 4
    # the CLI inside the fleet printed the same summary when it finished
    printed = (tmp_path / "run" / "fleet.log").read_text().rsplit("] done: ", 1)[1]
    assert json.loads(printed) == summary


@pytest.mark.slow
def test_fleet_async_stop_midway_ends_every_worker(tmp_path):
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", FAST + ["total_train_steps=200"])

    async def main():
        async with Fleet(cfg, run_dir=tmp_path / "run") as fleet:
            async for row in fleet.ametrics(poll_s=0.1):
                if row["step"] >= 1:
                    break
            pids = json.loads((tmp_path / "run" / "pids.json").read_text())
            code = await fleet.astop()
        return row, pids, code, fleet

    row, pids, code, fleet = asyncio.run(main())
    assert row["step"] == 1 and code == 143  # the CLI's code for SIGTERM
    assert not fleet.running()
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{name} (pid {pid}) outlived stop()"
    with pytest.raises(FileNotFoundError, match="has not finished"):
        fleet.summary()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_bad_inputs_are_refused_by_name(tmp_path):
    with pytest.raises(areal_async.config.ConfigError, match="total_train_steps"):
        Fleet(ROOT / "configs/tiny_arith.yaml", overrides=["total_train_steps=-1"])
    cfg = load_config(ROOT / "configs/tiny_arith.yaml")
    with pytest.raises(ValueError, match="overrides"):
        Fleet(cfg, overrides=["seed=2"])
    fleet = Fleet(cfg, run_dir=tmp_path)
    with pytest.raises(FleetError, match="start"):
        fleet.stop()


def test_top_level_import_is_light():
    code = "import sys, areal_async; areal_async.Fleet; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
