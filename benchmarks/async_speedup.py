"""Async speedup: trained samples/s at η = 0 (synchronous) vs η > 0, against the overlap limit.

Runs the real fleet at η = 0 and η = 1, 2, 4 and compares trained samples/s with the ideal
overlap limit computed from the synchronous run's own phase times.

    python -m benchmarks.async_speedup [--json PATH] [--etas 0 1 2 4] [--steps N] [--quick]
                                       [--config configs/tiny_arith.yaml] [--out DIR]
                                       [--rollout-workers N] [key=value overrides ...]

Each η is one real run (``areal-async run CONFIG --no-progress``, its own run directory under
``--out`` or a temp dir), same config, same seed, same fleet shape, only
``rollout.max_head_offpolicyness=η`` differs. Per run, from ``RUN_DIR/metrics.jsonl``:

- samples/s, steady state: trained samples between the metrics row of step ``WARMUP_STEPS``
  and the last row, over the wall time between them. This leaves out start-up and the SFT
  warm-up (both before step 0) and the first steps, while an async pipeline fills its
  η-batch backlog.
- time to 0.8: first step whose 10-step trailing moving average of ``reward_mean`` is >= 0.8
  (a full window is required); wall seconds since the end of step 0 (and that step's index);
  null if never reached.
- final reward: mean ``reward_mean`` of the last 10 steps; max staleness: max ``staleness_max``.

Phase times, from the η = 0 run over the same steady window (means per step):

- t_train = ``train_s + publish_s``: the trainer's PPO step (proximal logprob recompute and the
  update, timed in the trainer) plus publishing the new weights.
- t_gen = ``step_s - t_train``: everything else in a synchronous step, i.e. the scheduler
  admitting groups, the rollout worker loading the weights and decoding, the trajectories
  crossing to the trainer, rewards scored, the batch planned (``wait_data_s`` included). With
  η = 0 nothing of that overlaps training, so it is exactly the work an async pipeline may hide.
  ``t_gen_engine`` (rollout engines' busy seconds from heartbeats, summed over workers, per
  step) is shown beside it as the pure decode share; it is a cross-check, not used below.

ideal limit = (t_gen + t_train) / max(t_gen, t_train): perfect overlap, no contention.
speedup(η) = samples_per_s(η) / samples_per_s(0); fraction_of_limit = speedup / limit.
The limit assumes each phase costs in an async run what it cost in the synchronous one. It is
not a hard ceiling: with the trainer pinned, the async runs measured here needed ~12 % less
trainer CPU per step than the η = 0 run (0.22 vs 0.25 CPU-s: a core that never idles between
steps), and fraction_of_limit came out slightly above 1.

CPU accounting. While a run goes, a sampler thread reads every fleet process's CPU time from
/proc twice a second, named by role (scheduler, trainer, rollout-i, reward-i, reward-pool,
supervisor), and reports CPU seconds per step over the same steady window. On a machine with
few cores a step also cannot be shorter than (CPU seconds the whole fleet spends per step) /
cores, so ``limit_cpu`` = (t_gen + t_train) / max(t_gen, t_train, cpu_s_per_step(η=0) / cores)
is printed beside the ideal limit. It says how much of the gap to the ideal limit is the
machine (the rollout side's reward scoring, scheduler bookkeeping and message handling run in
processes of their own, so they need more CPU seconds than t_gen's wall seconds), not the
overlap logic.

Fleet shape. The CPU preset runs 2 rollout workers. On 2 cores that gives a synchronous run
both cores for generation, and an async run 3 compute processes (2 engines + trainer) for 2
cores. Measured here (80 steps, seed 1, same session): 2 workers: η=0 400 samples/s, η=2 453
(68 % of its limit 1.66x); 1 worker: η=0 340, η=2 486 (78 % of its limit 1.85x). So this
benchmark defaults to ``cluster.n_rollout_workers=1``: generation and training each get a
core, as each gets its own devices on a GPU cluster, and the η = 0 baseline runs the same
shape. It measures what asynchrony buys at a fixed fleet; it does not compare the best
synchronous fleet (2 workers here: against it, 1-worker η=2 is ~1.2x) with the best async one.
``--rollout-workers 2`` measures the preset's shape.

Placement. With 2 or more CPUs every run (η = 0 too) pins the trainer to the first CPU this
process may use and every other role to the rest (``cluster.cpu_affinity``; ``--no-pin`` turns it
off, and any ``cluster.cpu_affinity.*`` override replaces it). Without it, an async run's
trainer (the bottleneck: t_train >= t_gen here) loses time slices to bursts of decoding, reward
checks and message handling, and its step stretched from 0.25 s (η = 0) to 0.31-0.32 s (η = 2)
in the runs measured here; pinned, it stays at the synchronous run's 0.22-0.24 s. On a GPU
cluster the trainer has devices of its own; this is the CPU machine's equivalent.

Defaults: η 0 1 2 4, 300 steps each (the preset's run length; ~8 min on 2 cores); ``--quick``:
η 0 and 2, 30 steps (~70 s), too short for time to 0.8 or a stable final reward.

Covered: the whole control plane and data path of one machine (scheduler admission under the
staleness budget, ZeroMQ messages, tensor channels, reward workers, interrupt-and-resume
weight updates), the learning curve under staleness. Not covered: GPU engines (SGLang, NCCL),
several trainer ranks, generation lengths long enough for the interruptible-generation win
(the tiny task decodes at most 12 tokens), best-sync vs best-async fleet shapes. One run per η,
no repeats: a few % noise on a quiet machine, much more on a busy one, and an async run, which
keeps both cores busy, loses more to a neighbour than a synchronous one. So each run records the
1-minute load average before it and the CPU that processes outside the benchmark used during it
(``foreign_cpu_frac``: share of one core, from /proc/stat minus this process tree's own CPU);
``--quiet-wait S`` waits up to S seconds before each run for the machine to go quiet. The
median-based samples/s (batch / median step time) is a burst-resistant cross-check.

JSON: one row per η: ``metric`` ("trained_samples_per_s"), ``value``, ``unit`` ("samples/s"),
``eta``, ``samples_per_s``, ``speedup``, ``limit``, ``fraction_of_limit``, ``final_reward``,
``time_to_0.8`` (s or null), ``steps_to_0.8``, ``staleness_max``, ``t_gen``, ``t_train``,
``t_gen_engine`` (s per step, of the η = 0 run), ``limit_cpu``, ``fraction_of_cpu_limit``,
``cpu_s_per_step`` ({role: CPU s per step} of that run), ``n_cores``, ``samples_per_s_median``,
``steps``, ``n_rollout_workers``, ``seed``, ``loadavg_before``, ``foreign_cpu_frac``,
``meets_target`` (η = 2 target below; null at η = 0), ``bound`` (how the figure is bounded),
``run_dir``. Target on the 2-core CPU machine: at η = 2, fraction_of_limit >= 0.8 with a
final reward no more than 0.05 below the η = 0 run's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import write_rows

THRESHOLD = 0.8
MA_WINDOW = 10
FINAL_WINDOW = 10
WARMUP_STEPS = 5
TARGET_ETA, TARGET_FRACTION, TARGET_REWARD_DROP = 2, 0.80, 0.05
RUN_TIMEOUT_S = 1200.0
DEFAULT_STEPS, QUICK_STEPS = 300, 30  # 300: the preset's run length


# --------------------------------------------------------------------------------------------
# pure parts: metrics rows -> figures
# --------------------------------------------------------------------------------------------


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing means over full windows: element i is mean(xs[i : i + window])."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [sum(xs[i:i + window]) / window for i in range(len(xs) - window + 1)]


def time_to_threshold(rows: list[dict], threshold: float = THRESHOLD,
                      window: int = MA_WINDOW) -> tuple[Optional[int], Optional[float]]:
    """(step, seconds since the end of step 0) where the trailing average first reaches threshold."""
    ma = moving_average([r["reward_mean"] for r in rows], window)
    for i, v in enumerate(ma):
        if v >= threshold:
            last = rows[i + window - 1]
            return last["step"], last["wall_s"] - rows[0]["wall_s"]
    return None, None


def _window(rows: list[dict], skip: int) -> list[dict]:
    if len(rows) < skip + 2:
        raise ValueError(f"need at least {skip + 2} metrics rows (warm-up {skip} + 2), got {len(rows)}")
    return rows[skip:]


def steady_samples_per_s(rows: list[dict], skip: int = WARMUP_STEPS) -> float:
    """Trained samples per wall second from row `skip` to the last row."""
    w = _window(rows, skip)
    dt = w[-1]["wall_s"] - w[0]["wall_s"]
    if dt <= 0:
        raise ValueError(f"wall_s does not increase over the steady window ({w[0]['wall_s']} -> {w[-1]['wall_s']})")
    return (w[-1]["samples_trained_total"] - w[0]["samples_trained_total"]) / dt


def phase_times(rows: list[dict], skip: int = WARMUP_STEPS) -> dict:
    """Mean per-step t_gen, t_train, t_gen_engine (s) of a synchronous run; see the docstring."""
    steps = _window(rows, skip)[1:]  # each row's step_s ends at that row: these lie inside the window
    n = len(steps)
    step_s = sum(r["step_s"] for r in steps) / n
    t_train = sum(r["train_s"] + r["publish_s"] for r in steps) / n
    engine = (steps[-1]["gen_busy_s_total"] - rows[skip]["gen_busy_s_total"]) / n
    return {"t_gen": step_s - t_train, "t_train": t_train, "t_gen_engine": engine, "step_s": step_s}


def ideal_limit(t_gen: float, t_train: float) -> float:
    """Speedup of perfect generation/training overlap: (t_gen + t_train) / max(t_gen, t_train)."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) <= 0:
        raise ValueError(f"phase times must be >= 0 and not both 0, got t_gen={t_gen}, t_train={t_train}")
    return (t_gen + t_train) / max(t_gen, t_train)


def cpu_per_step(samples: list[tuple[int, dict[str, float]]], skip: int = WARMUP_STEPS) -> dict[str, float]:
    """CPU seconds per trainer step by role over the steady window, from (metrics rows, {role: cpu s}) samples.

    From the first sample that has row `skip` to the last one in which every role of that first
    sample is still present (a worker that exited loses its final reading)."""
    start = next((i for i, (n, _) in enumerate(samples) if n >= skip + 1), None)
    if start is None:
        return {}
    n0, c0 = samples[start]
    end = max((i for i in range(start, len(samples)) if set(c0) <= set(samples[i][1])), default=start)
    n1, c1 = samples[end]
    if n1 <= n0:
        return {}
    return {role: (c1[role] - c0[role]) / (n1 - n0) for role in sorted(c0)}


def cpu_limit(t_gen: float, t_train: float, cpu_s_per_step: float, n_cores: int) -> float:
    """The ideal limit with the machine's CPU capacity as a third bound: a step can't take less
    than (all CPU seconds a step needs) / cores."""
    return (t_gen + t_train) / max(t_gen, t_train, cpu_s_per_step / n_cores)


def summarize_run(eta: int, rows: list[dict], skip: int = WARMUP_STEPS) -> dict:
    """The per-run figures (no comparison yet)."""
    if not rows:
        raise ValueError(f"η={eta}: no metrics rows")
    step, secs = time_to_threshold(rows)
    tail = [r["reward_mean"] for r in rows[-FINAL_WINDOW:]]
    return {"eta": eta, "steps": len(rows), "samples_per_s": steady_samples_per_s(rows, skip),
            "time_to_0.8": secs, "steps_to_0.8": step, "final_reward": sum(tail) / len(tail),
            "staleness_max": max(r["staleness_max"] for r in rows), "phases": phase_times(rows, skip),
            "samples_per_s_median": _median_samples_per_s(rows, skip)}


def _median_samples_per_s(rows: list[dict], skip: int) -> float:
    """Burst-resistant cross-check: median samples per step / median step_s over the window."""
    steps = _window(rows, skip)[1:]
    return statistics.median(r["samples_trained"] for r in steps) / statistics.median(r["step_s"] for r in steps)


def compare(runs: list[dict], n_cores: Optional[int] = None) -> dict:
    """Add speedup, limit and fraction_of_limit to every run, against the η = 0 run's phases.

    With n_cores and the η = 0 run's ``cpu_s_per_step``, also the CPU-capacity limit."""
    base = next((r for r in runs if r["eta"] == 0), None)
    if base is None:
        raise ValueError(f"an η = 0 run is required as the baseline, got η = {[r['eta'] for r in runs]}")
    ph = base["phases"]
    limit = ideal_limit(ph["t_gen"], ph["t_train"])
    cpu = base.get("cpu_s_per_step") or {}
    lim_cpu = cpu_limit(ph["t_gen"], ph["t_train"], sum(cpu.values()), n_cores) if cpu and n_cores else None
    for r in runs:
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        r["fraction_of_limit"] = r["speedup"] / limit
        r["fraction_of_cpu_limit"] = None if lim_cpu is None else r["speedup"] / lim_cpu
        r["reward_drop"] = base["final_reward"] - r["final_reward"]
    return {"limit": limit, "limit_cpu": lim_cpu, "t_gen": ph["t_gen"], "t_train": ph["t_train"],
            "t_gen_engine": ph["t_gen_engine"], "cpu_s_per_step": sum(cpu.values()) if cpu else None,
            "n_cores": n_cores, "base_final_reward": base["final_reward"]}


def target_met(run: dict) -> bool:
    return run["fraction_of_limit"] >= TARGET_FRACTION and run["reward_drop"] <= TARGET_REWARD_DROP


def to_rows(runs: list[dict], cmp: dict, meta: dict) -> list[dict]:
    bound = (f"ideal overlap limit {cmp['limit']:.3f}x from the η=0 run (t_gen {cmp['t_gen']:.3f}s, "
             f"t_train {cmp['t_train']:.3f}s per step); steady window from step {WARMUP_STEPS}")
    out = []
    for r in runs:
        row = {"metric": "trained_samples_per_s", "value": r["samples_per_s"], "unit": "samples/s", "eta": r["eta"],
               "samples_per_s": r["samples_per_s"], "speedup": r["speedup"], "limit": cmp["limit"],
               "fraction_of_limit": r["fraction_of_limit"], "final_reward": r["final_reward"],
               "reward_drop_vs_sync": r["reward_drop"], "time_to_0.8": r["time_to_0.8"],
               "steps_to_0.8": r["steps_to_0.8"], "staleness_max": r["staleness_max"], "t_gen": cmp["t_gen"],
               "t_train": cmp["t_train"], "t_gen_engine": cmp["t_gen_engine"], "steps": r["steps"],
               "samples_per_s_median": r["samples_per_s_median"], "limit_cpu": cmp["limit_cpu"],
               "fraction_of_cpu_limit": r["fraction_of_cpu_limit"], "n_cores": cmp["n_cores"],
               "meets_target": target_met(r) if r["eta"] else None, "bound": bound}
        row.update({k: r[k] for k in ("cpu_s_per_step", "loadavg_before", "foreign_cpu_frac", "run_dir", "run_wall_s")
                    if k in r})
        row.update(meta)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# running the fleet
# --------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cpu_busy_s() -> Optional[float]:
    """Machine-wide non-idle CPU seconds since boot (Linux /proc/stat; hypervisor steal counts as
    busy: it is CPU this machine did not get), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped descendants (the fleet, once it exited)."""
    import resource

    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in ru)


def wait_quiet(max_wait_s: float, max_cores: float = 0.25, sample_s: float = 3.0) -> float:
    """Wait (up to max_wait_s) until other processes use < max_cores; returns the last sample."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0 = cpu_busy_s()
        if b0 is None:
            return float("nan")
        time.sleep(sample_s)
        busy = (cpu_busy_s() - b0) / sample_s
        if busy < max_cores or time.monotonic() >= deadline:
            return busy
        print(f"[async_speedup] machine busy ({busy:.2f} cores in use by others); waiting", flush=True)


class TreeCPU(threading.Thread):
    """Samples, every period_s, the CPU seconds of each role in a process tree (Linux /proc)
    together with the number of metrics rows written so far: ``samples`` for `cpu_per_step`."""

    def __init__(self, root_pid: int, metrics_path: Path, period_s: float = 0.5):
        super().__init__(name="tree-cpu", daemon=True)
        self.root, self.metrics_path, self.period_s = root_pid, metrics_path, period_s
        self.samples: list[tuple[int, dict[str, float]]] = []
        self.roles: dict[int, str] = {}  # pid -> role, named at first sight (a zombie has no cmdline)
        self.last: dict[int, float] = {}  # pid -> CPU seconds at its last reading
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            n = _count_lines(self.metrics_path)
            per_role: dict[str, float] = {}
            for pid, cpu in _tree_cpu(self.root).items():
                self.last[pid] = cpu
                role = self.roles.setdefault(pid, _role(pid))
                per_role[role] = per_role.get(role, 0.0) + cpu
            self.samples.append((n, per_role))


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _stat(pid: int) -> Optional[tuple[int, float]]:
    """(parent pid, user + system CPU seconds) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int) -> dict[int, float]:
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return out


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            argv = f.read().split("\0")
    except OSError:
        return "unknown"
    if "--worker-id" in argv[:-1]:
        return argv[argv.index("--worker-id") + 1]
    if "areal_async.reward._child" in argv:
        return "reward-pool"
    return "supervisor" if any("areal_async.cli" in a or "areal-async" in a for a in argv) else "other"


def run_fleet(config: str, overrides: list[str], run_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """One `areal-async run`; returns its metrics rows and how busy the machine was meanwhile."""
    cmd = [sys.executable, "-m", "areal_async.cli", "run", config, "--run-dir", str(run_dir), "--no-progress",
           *overrides]
    log_path = run_dir.with_suffix(".log")
    load = os.getloadavg()[0]
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        sampler = TreeCPU(proc.pid, run_dir / "metrics.jsonl")
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:  # timeout or Ctrl-C: the supervisor stops its own workers on SIGTERM
            _stop(proc)
            raise
        finally:
            sampler.done.set()
            sampler.join()
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}): {' '.join(cmd)}; see {log_path} and {run_dir}/logs")
    # two lower bounds of the fleet's CPU: what reaped descendants report (an orphan reaped by init
    # is missing) and the sampler's last readings (a process's final half second is missing)
    own = max(own_cpu_s() - own0, sum(sampler.last.values()))
    foreign = None if busy0 is None else max(0.0, (cpu_busy_s() - busy0) - own) / wall
    return {"rows": read_metrics(run_dir / "metrics.jsonl"), "loadavg_before": load, "foreign_cpu_frac": foreign,
            "run_wall_s": wall, "cpu_samples": sampler.samples}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the supervisor we started (it drains its workers), SIGKILL it after a grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(runs: list[dict], cmp: dict, meta: dict) -> None:
    print(f"\nasync speedup: {meta['config']}, {meta['n_rollout_workers']} rollout worker(s), "
          f"{meta['steps_requested']} steps, batch {meta['batch_samples']} samples, seed {meta['seed']}, "
          f"{meta['cpu_count']} CPUs")
    pins = meta.get("placement") or {}
    print("placement: " + (", ".join(f"{r} on CPU {c}" for r, c in pins.items() if c) or "not pinned"))
    print(f"η=0 phases per step: t_gen {cmp['t_gen']:.3f}s (engine busy {cmp['t_gen_engine']:.3f}s), "
          f"t_train {cmp['t_train']:.3f}s -> ideal limit {cmp['limit']:.3f}x")
    if cmp["limit_cpu"] is not None:
        print(f"η=0 CPU per step, all fleet processes: {cmp['cpu_s_per_step']:.3f} CPU-s on {cmp['n_cores']} cores "
              f"-> CPU-capacity limit {cmp['limit_cpu']:.3f}x")
    print(f"{'eta':>3} {'samples/s':>10} {'(median)':>9} {'speedup':>8} {'of limit':>9} {'of cpu lim':>10} "
          f"{'t->0.8 s':>9} {'step':>5} {'final rwd':>9} {'stale':>5} {'cpu-s/step':>10} {'load1':>6} {'others':>7}")
    for r in runs:
        cpu = sum(r["cpu_s_per_step"].values()) if r.get("cpu_s_per_step") else None
        print(f"{r['eta']:>3} {r['samples_per_s']:>10.1f} {r['samples_per_s_median']:>9.1f} {r['speedup']:>8.3f} "
              f"{r['fraction_of_limit']:>9.1%} {_fmt(r['fraction_of_cpu_limit'], '.1%'):>10} "
              f"{_fmt(r['time_to_0.8'], '.1f'):>9} {_fmt(r['steps_to_0.8'], 'd'):>5} {r['final_reward']:>9.3f} "
              f"{r['staleness_max']:>5} {_fmt(cpu, '.3f'):>10} {r.get('loadavg_before', 0):>6.2f} "
              f"{_fmt(r.get('foreign_cpu_frac'), '.0%'):>7}")
    tgt = next((r for r in runs if r["eta"] == TARGET_ETA), None)
    if tgt is not None:
        print(f"target η={TARGET_ETA}: >= {TARGET_FRACTION:.0%} of limit and final reward >= η=0's - "
              f"{TARGET_REWARD_DROP}: {'met' if target_met(tgt) else 'NOT met'} "
              f"({tgt['fraction_of_limit']:.1%}, reward {tgt['final_reward']:.3f} vs {cmp['base_final_reward']:.3f})")
    for r in runs:
        if r.get("cpu_s_per_step"):
            print(f"  η={r['eta']} CPU-s per step by process: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s_per_step"].items()))
    print("others = CPU used by processes outside the benchmark during the run (share of one core); the "
          "figures are only meaningful when it is near 0")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="key=value config overrides (any position) apply to every run")
    ap.add_argument("--json", default=None, help="where to write the JSON list of rows")
    ap.add_argument("--etas", type=int, nargs="+", default=None, help="η values (0 is always run); default 0 1 2 4")
    ap.add_argument("--steps", type=int, default=None, help=f"RL steps per run (default {DEFAULT_STEPS})")
    ap.add_argument("--config", default="configs/tiny_arith.yaml")
    ap.add_argument("--rollout-workers", type=int, default=1, help="cluster.n_rollout_workers (see docstring)")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: η 0 and 2, {QUICK_STEPS} steps (~70 s)")
    ap.add_argument("--out", default=None, help="directory for the run dirs (default: a fresh temp dir, kept)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the trainer to a CPU of its own (see "
                                                              "the docstring, 'Placement')")
    ap.add_argument("--quiet-wait", type=float, default=0.0, help="before each run, wait up to this many seconds "
                                                                  "for other processes to go quiet")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    ap = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # key=value overrides may sit anywhere, even after --etas 0 1 2 (which would swallow them)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.overrides = overrides
    etas = sorted(set([0] + (args.etas or ([0, TARGET_ETA] if args.quick else [0, 1, 2, 4]))))
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if min(etas) < 0 or steps < WARMUP_STEPS + MA_WINDOW or args.rollout_workers < 1:
        ap.error(f"need η >= 0, --steps >= {WARMUP_STEPS + MA_WINDOW}, --rollout-workers >= 1; "
                 f"got η={etas}, steps={steps}, rollout-workers={args.rollout_workers}")
    if any(o.startswith("rollout.max_head_offpolicyness=") for o in args.overrides):
        ap.error("set η with --etas, not rollout.max_head_offpolicyness=")
    pins = [] if args.no_pin else placement(sorted(os.sched_getaffinity(0)), args.overrides)
    base = [f"total_train_steps={steps}", f"cluster.n_rollout_workers={args.rollout_workers}", *pins, *args.overrides]
    meta = _meta(args.config, base, steps)
    out = Path(args.out or tempfile.mkdtemp(prefix="async_speedup-")).resolve()
    taken = [str(out / f"eta{eta}") for eta in etas if (out / f"eta{eta}").exists()]
    if taken:
        ap.error(f"run directories already exist: {', '.join(taken)}; use a new --out")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for eta in etas:
        if args.quiet_wait > 0:
            wait_quiet(args.quiet_wait)
        run_dir = out / f"eta{eta}"
        print(f"[async_speedup] η={eta}: {run_dir}", flush=True)
        res = run_fleet(args.config, base + [f"rollout.max_head_offpolicyness={eta}"], run_dir)
        runs.append({**summarize_run(eta, res.pop("rows")), "cpu_s_per_step": cpu_per_step(res.pop("cpu_samples")),
                     **res, "run_dir": str(run_dir)})
    cmp = compare(runs, os.cpu_count())
    print_table(runs, cmp, meta)
    rows = to_rows(runs, cmp, {k: meta[k] for k in ("n_rollout_workers", "seed", "batch_samples", "placement")})
    if args.json:
        write_rows(args.json, rows)
        print(f"rows written to {args.json}")
    return rows


def placement(cpus: list[int], overrides: list[str]) -> list[str]:
    """Overrides that give the trainer ``cpus[0]`` and every other role the rest; none with fewer
    than 2 CPUs or when the caller set any ``cluster.cpu_affinity`` key (their placement wins)."""
    if len(cpus) < 2 or any(o.startswith("cluster.cpu_affinity.") for o in overrides):
        return []
    rest = ",".join(str(c) for c in cpus[1:])
    return [f"cluster.cpu_affinity.trainer={cpus[0]}"] + [f"cluster.cpu_affinity.{r}={rest}"
                                                          for r in ("scheduler", "rollout", "reward")]


def _meta(config: str, overrides: list[str], steps: int) -> dict:
    """The resolved settings every run shares (validates the overrides before anything starts)."""
    from areal_async.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise SystemExit(f"async_speedup: config error: {e}")
    aff = cfg.cluster.cpu_affinity
    return {"config": config, "n_rollout_workers": cfg.cluster.n_rollout_workers, "seed": cfg.seed,
            "placement": {r: getattr(aff, r) for r in ("trainer", "scheduler", "rollout", "reward")},
            "batch_samples": cfg.train_dataset.batch_size * cfg.gconfig.n_samples, "steps_requested": steps,
            "cpu_count": os.cpu_count()}


if __name__ == "__main__":
    main()
