"""One real fleet run for a benchmark: ``areal-async run CONFIG --no-progress`` as a subprocess.

``run_fleet`` starts it in its own session, samples its processes' CPU per role (``cpu.TreeCPU``,
progress = metrics rows written), and returns its metrics rows with how busy the machine was:
the 1-minute load average before, and ``foreign_cpu_frac``, the CPU that processes outside the
benchmark used meanwhile (share of one core: /proc/stat minus this process tree's own CPU).
``placement`` gives the trainer a CPU of its own (``cluster.cpu_affinity`` overrides).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from areal_async.api import run_command
from areal_async.config import ConfigError, load_config
from benchmarks.common.cpu import TreeCPU, count_lines, cpu_busy_s, own_cpu_s

RUN_TIMEOUT_S = 1200.0


def read_metrics(path: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_fleet(config: str, overrides: list[str], run_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """One `areal-async run`; returns its metrics ``rows``, ``cpu_samples`` (for ``cpu.cpu_per_step``),
    ``loadavg_before``, ``foreign_cpu_frac``, ``run_wall_s`` and ``cpu_s`` (the fleet's CPU seconds). Raises
    naming the log on a failed run."""
    cmd = run_command(config, run_dir, overrides)
    log_path = run_dir.with_suffix(".log")
    load = os.getloadavg()[0]
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        sampler = TreeCPU(proc.pid, lambda: count_lines(run_dir / "metrics.jsonl"))
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:  # timeout or Ctrl-C: the supervisor stops its own workers on SIGTERM
            stop(proc)
            raise
        finally:
            sampler.stop()
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}): {' '.join(cmd)}; see {log_path} and {run_dir}/logs")
    # two lower bounds of the fleet's CPU: what reaped descendants report (an orphan reaped by init
    # is missing) and the sampler's last readings (a process's final half second is missing)
    own = max(own_cpu_s() - own0, sum(sampler.last.values()))
    foreign = None if busy0 is None else max(0.0, (cpu_busy_s() - busy0) - own) / wall
    return {
        "rows": read_metrics(run_dir / "metrics.jsonl"),
        "loadavg_before": load,
        "foreign_cpu_frac": foreign,
        "run_wall_s": wall,
        "cpu_s": own,
        "cpu_samples": sampler.samples,
    }


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the supervisor we started (it drains its workers), SIGKILL it after a grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def placement(cpus: list[int], overrides: list[str]) -> list[str]:
    """Overrides that give the trainer ``cpus[0]`` and every other role the rest; none with fewer
    than 2 CPUs or when the caller set any ``cluster.cpu_affinity`` key (their placement wins)."""
    if len(cpus) < 2 or any(o.startswith("cluster.cpu_affinity.") for o in overrides):
        return []
    rest = ",".join(str(c) for c in cpus[1:])
    return [f"cluster.cpu_affinity.trainer={cpus[0]}"] + [
        f"cluster.cpu_affinity.{r}={rest}" for r in ("scheduler", "rollout", "reward")
    ]


def fleet_meta(config: str, overrides: list[str]) -> dict:
    """The resolved settings a benchmark's runs share; validates config and overrides before anything
    starts (SystemExit naming the bad key or value)."""
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise SystemExit(f"benchmark config error: {e}") from None
    aff = cfg.cluster.cpu_affinity
    return {
        "config": config,
        "n_rollout_workers": cfg.cluster.n_rollout_workers,
        "seed": cfg.seed,
        "placement": {r: getattr(aff, r) for r in ("trainer", "scheduler", "rollout", "reward")},
        "batch_samples": cfg.train_dataset.batch_size * cfg.gconfig.n_samples,
        "cpu_count": os.cpu_count(),
    }
