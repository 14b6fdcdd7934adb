"""The Python API: load a config in code and run a fleet from a program, as the CLI does.

    from areal_async import Fleet, load_config

    cfg = load_config("configs/tiny_arith.yaml", ["total_train_steps=20"])
    with Fleet(cfg, run_dir="runs/api") as fleet:    # start(); stop() on leaving the block
        for row in fleet.metrics():                  # one metrics.jsonl row per trainer step, live
            print(row["step"], row["reward_mean"])
        code = fleet.wait()                          # the CLI's exit code (0: done)
    print(fleet.summary())                           # RUN_DIR/summary.json

``Fleet`` starts ``areal-async run`` as a child process (its own session, so stopping it stops
every worker it started and nothing else) on the run directory it writes: the run directory
contract is the CLI's, byte for byte, and ``RUN_DIR/fleet.log`` holds the supervisor's output.
The async forms (``astart``, ``await_``, ``ametrics``, ``astop``) do the same without blocking
an event loop. Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Iterator, Optional, Sequence

from areal_async.base.private import private_dir
from areal_async.base.records import JsonlTail
from areal_async.config import ExperimentConfig, load_config, to_yaml

__all__ = ["Fleet", "FleetError", "run_command"]


def run_command(
    config: str | Path, run_dir: str | Path, overrides: Sequence[str] = (), progress: bool = False
) -> list[str]:
    """The argv of ``areal-async run CONFIG --run-dir RUN_DIR [--no-progress] OVERRIDES...`` as this interpreter
    runs it (``python -m areal_async.cli``: the checkout that builds the command is the one that runs). The one
    builder of the command: ``Fleet`` here, the tests (tests/support/fleet.py) and the benchmarks use it."""
    cmd = [sys.executable, "-m", "areal_async.cli", "run", str(config), "--run-dir", str(run_dir)]
    return cmd + ([] if progress else ["--no-progress"]) + [str(o) for o in overrides]


class FleetError(RuntimeError):
    """The fleet was used out of order (e.g. waited on before it was started)."""


class Fleet:
    """One training run of ``cfg`` in ``run_dir`` (default ``runs/<experiment_name>-<time>``)."""

    def __init__(
        self,
        cfg: ExperimentConfig | str | Path,
        run_dir: str | Path | None = None,
        overrides: Sequence[str] = (),
        progress: bool = False,
    ):
        if not isinstance(cfg, ExperimentConfig):
            cfg = load_config(cfg, list(overrides))
        elif overrides:
            raise ValueError(
                f"overrides {list(overrides)!r} apply to a YAML path; "
                "for a config object use load_config(path, overrides) first"
            )
        cfg.validate()
        self.cfg = cfg
        self.run_dir = Path(run_dir or f"runs/{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        self.progress = progress
        self.proc: Optional[subprocess.Popen] = None

    # ---- sync ----------------------------------------------------------------------------
    def start(self) -> "Fleet":
        if self.proc is not None:
            raise FleetError(f"fleet in {self.run_dir} was already started (pid {self.proc.pid})")
        private_dir(self.run_dir)  # 0700, as the supervisor makes it (base/private.py)
        cfg_path = self.run_dir / "fleet_config.yaml"
        cfg_path.write_text(to_yaml(self.cfg, changed_only=True))  # the keys set, as a user writes them
        cmd = run_command(cfg_path, self.run_dir, progress=self.progress)
        with open(self.run_dir / "fleet.log", "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=_env()
            )
        return self

    @property
    def returncode(self) -> Optional[int]:
        """None while running (or not started); else the CLI's exit code."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit code once the run ends; ``TimeoutError`` naming the run if it outlasts ``timeout``."""
        proc = self._started()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"fleet in {self.run_dir} still running after {timeout}s") from None

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM the supervisor (it stops every worker it started), SIGKILL its group after ``grace_s``."""
        proc = self._started()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def metrics(self, poll_s: float = 0.25) -> Iterator[dict]:
        """Every ``metrics.jsonl`` row, as the trainer steps; ends when the run has ended and all are read."""
        self._started()
        tail = JsonlTail(self.run_dir / "metrics.jsonl")
        while True:
            ended = not self.running()
            yield from tail.read()
            if ended:
                return
            time.sleep(poll_s)

    def summary(self) -> dict:
        """``RUN_DIR/summary.json`` (written by the scheduler when the run finished)."""
        path = self.run_dir / "summary.json"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: the run has not finished (returncode "
                f"{self.returncode}; see {self.run_dir / 'fleet.log'})"
            )
        return json.loads(path.read_text())

    def __enter__(self) -> "Fleet":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        if self.running():
            self.stop()

    # ---- async ---------------------------------------------------------------------------
    async def astart(self) -> "Fleet":
        return self.start()  # Popen returns at once

    async def await_(self, poll_s: float = 0.25) -> int:
        """Async ``wait``: the exit code once the run ends."""
        proc = self._started()
        while proc.poll() is None:
            await asyncio.sleep(poll_s)
        return proc.returncode

    async def ametrics(self, poll_s: float = 0.25) -> AsyncIterator[dict]:
        """Async ``metrics``."""
        self._started()
        tail = JsonlTail(self.run_dir / "metrics.jsonl")
        while True:
            ended = not self.running()
            for row in tail.read():
                yield row
            if ended:
                return
            await asyncio.sleep(poll_s)

    async def astop(self, grace_s: float = 30.0) -> int:
        return await asyncio.to_thread(self.stop, grace_s)

    async def __aenter__(self) -> "Fleet":
        return await self.astart() if self.proc is None else self

    async def __aexit__(self, *exc) -> None:
        if self.running():
            await self.astop()

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise FleetError(f"fleet in {self.run_dir} was not started: call start() first")
        return self.proc


def _env() -> dict:
    """The child's environment, with this checkout importable (a program may run from anywhere)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))
