"""The local supervisor: one machine, one process per worker, watched until the run ends.

``run_local(cfg, run_dir)`` writes the run directory (resolved config, endpoints), starts the
scheduler, the reward workers, the trainer and the rollout workers as child processes (each in
its own process group, logging to ``RUN_DIR/logs/<worker>.log``), and then watches them:

- all children exit 0 after the scheduler's Shutdown          -> the run succeeded (exit 0);
- a rollout or reward worker exits non-zero (or dies by a signal) -> it is restarted with the
  same command, up to ``cluster.max_restarts`` times each (zmq/shm tensor channels only: a
  gloo/NCCL group cannot take in a new process); the scheduler re-issues the work it held;
- any other child dies, or restarts are used up / impossible  -> the run fails loudly: the dead
  worker's last log lines are printed, every other child is stopped, exit 1;
- SIGINT / SIGTERM to the supervisor                          -> every child it started is
  stopped (SIGTERM to its process group, SIGKILL after a grace period), exit 130 / 143.

It only ever signals the pids it started (and their process groups), never by name.
A live progress line (step, reward, staleness, samples/s) is drawn from ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_async.base.affinity import check_available
from areal_async.base.endpoints import plan_endpoints
from areal_async.base.runkeys import TOKEN_ENV, write_run_keys
from areal_async.config import ExperimentConfig, to_yaml
from areal_async.supervisor.launchers import Launched, Launcher, LocalLauncher
from areal_async.supervisor.servers import SERVER_ROLES, launch_blocker, plan_server_addresses, server_commands
from areal_async.supervisor.placement import (PlacementError, Slot, check_gpus_present, local_gpu_count, place,
                                              shape_of, trainer_names)
from protocols.sockets import free_tcp_port
from areal_async.trainer.checkpoint_dirs import checkpoint_to_resume

GRACE_S = 5.0
RUN_END_GRACE_S = 30.0  # how long workers may outlive a scheduler that finished the run


class LaunchError(RuntimeError):
    """The run cannot start as asked (the run dir holds another run or no checkpoint; CPUs not available)."""


@dataclass
class Child:
    name: str
    proc: Launched
    log_path: Path
    cmd: list = field(default_factory=list)
    env: Optional[dict] = None  # its environment (devices included), reused by a restart
    restarts: int = 0

    @property
    def role(self) -> str:  # "rollout-1" -> "rollout"
        return self.name.split("-")[0]


RESTARTABLE = ("rollout", "reward", *SERVER_ROLES)  # the trainer resumes from a checkpoint instead (recover.mode)


def restart_blocker(cfg: ExperimentConfig) -> Optional[str]:
    """Why a dead worker of this config cannot be restarted, or None."""
    if cfg.cluster.max_restarts == 0:
        return "cluster.max_restarts=0"
    fixed = sorted({cfg.tensor_channel.trajectories, cfg.tensor_channel.weights} - {"zmq", "shm"})
    if fixed:
        return f"tensor channel(s) {', '.join(fixed)} form a fixed process group that a new process cannot join"
    return None


def check_placement(cfg: ExperimentConfig) -> None:
    """LaunchError (before anything starts) if a pinned role names CPUs this machine does not allow."""
    for role, spec in dataclasses.asdict(cfg.cluster.cpu_affinity).items():
        if spec:
            try:
                check_available(spec, f"cluster.cpu_affinity.{role}")
            except ValueError as e:
                raise LaunchError(str(e)) from None


def device_placement(cfg: ExperimentConfig, gpus_here: Optional[int] = None) -> dict[str, Slot]:
    """Every process's devices (supervisor/placement.py); LaunchError before anything starts when
    the cluster or this machine (node 0, the local launcher's) has fewer GPUs than asked."""
    try:
        placement = place(shape_of(cfg))
        if cfg.cluster.device == "cuda":
            check_gpus_present(placement, 0, local_gpu_count() if gpus_here is None else gpus_here)
    except PlacementError as e:
        raise LaunchError(str(e)) from None
    return placement


def device_env(cfg: ExperimentConfig, slot: Optional[Slot]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES / LOCAL_RANK of a process on GPU runs; nothing on CPU runs."""
    return slot.env() if slot is not None and cfg.cluster.device == "cuda" else {}


def worker_specs(cfg: ExperimentConfig) -> list[tuple[str, str, int]]:
    """(worker id, module, index) in start order."""
    specs = [("scheduler", "workers.scheduler", 0)]
    specs += [(f"reward-{i}", "workers.reward", i) for i in range(cfg.cluster.n_reward_workers)]
    specs += [(w, "workers.trainer", r) for r, w in enumerate(trainer_names(cfg.cluster.n_trainer_ranks))]
    specs += [(f"rollout-{i}", "workers.rollout", i) for i in range(cfg.cluster.n_rollout_workers)]
    return specs


class LocalSupervisor:
    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, progress: Optional[bool] = None,
                 launcher: Optional[Launcher] = None):
        self.cfg, self.run_dir = cfg, Path(run_dir).resolve()
        self.launcher = launcher or LocalLauncher()
        self.progress = cfg.stats_logger.progress if progress is None else progress
        self.children: list[Child] = []
        self.placement: dict[str, Slot] = {}  # worker id -> devices, set by prepare()
        self.t0 = time.time()
        self._signal: Optional[int] = None
        self._run_end_seen: Optional[float] = None  # when the scheduler was first seen exited 0
        self.tokens: dict[str, str] = {}  # worker id -> launch token (written by prepare)

    # ---- set-up --------------------------------------------------------------------------
    def prepare(self) -> None:
        check_placement(self.cfg)
        if why := launch_blocker(self.cfg):
            raise LaunchError(why)
        self.placement = device_placement(self.cfg)
        resume = self.resume_point()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        cl = self.cfg.cluster  # built-in reward workers bind the first endpoints, bring-your-own ones the rest
        self.endpoints = plan_endpoints(cl.n_reward_workers + cl.n_external_reward_workers, self.cfg.cluster.host,
                                        self.cfg.cluster.control)
        self.endpoints.extra["resume_from"] = str(resume) if resume else None
        self.endpoints.extra["servers"] = plan_server_addresses(self.cfg)
        host = self.cfg.cluster.host
        self.endpoints.extra["trainer_store"] = f"{host}:{free_tcp_port(host)}"  # the trainer ranks' group
        # keys before endpoints.json: whoever finds the endpoints finds the keys (bring-your-own workers)
        self.tokens = write_run_keys(self.run_dir, {wid: module.rsplit(".", 1)[-1]
                                                    for wid, module, _ in worker_specs(self.cfg)})
        self.endpoints.save(self.run_dir)
        if resume:
            print(f"[areal-async] resuming from {resume}")

    def resume_point(self) -> Optional[Path]:
        """The newest complete checkpoint to resume from, per recover.mode; refuses to mix runs."""
        books = self.run_dir / "metrics.jsonl"
        if self.cfg.recover.mode == "disabled" and books.exists() and books.stat().st_size > 0:
            raise LaunchError(f"{self.run_dir} already holds a run (metrics.jsonl); use a new --run-dir "
                              "or recover.mode=auto to continue it")
        try:
            return checkpoint_to_resume(self.run_dir / "checkpoints", self.cfg.recover.mode)
        except ValueError as e:
            raise LaunchError(str(e)) from None

    def start_all(self) -> None:
        env = dict(os.environ, AREAL_T0=repr(self.t0), OMP_NUM_THREADS=str(self.cfg.cluster.torch_threads),
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self._start_servers(env)
        for wid, module, idx in worker_specs(self.cfg):
            log_path = self.run_dir / "logs" / f"{wid}.log"
            cmd = [sys.executable, "-m", module, "--run-dir", str(self.run_dir), "--worker-id", wid,
                   "--index", str(idx)]
            if cpus := getattr(self.cfg.cluster.cpu_affinity, module.rsplit(".", 1)[-1]):
                cmd += ["--cpus", cpus]
            child_env = env | device_env(self.cfg, self.placement.get(wid)) | self._token_env(wid)
            self.children.append(Child(wid, self._spawn(cmd, log_path, child_env), log_path, cmd, env=child_env))
        self._env = env
        self._write_pids()

    def _start_servers(self, env: dict) -> None:
        """The rollout backend's inference servers (sglang, vllm), before the workers that use them."""
        for name, cmd in server_commands(self.cfg, self.run_dir, self.endpoints.extra["servers"]):
            log_path = self.run_dir / "logs" / f"{name}.log"
            self.children.append(Child(name, self._spawn(cmd, log_path, env), log_path, cmd))

    def _stop_servers(self) -> None:
        """Servers never exit by themselves: stop them once every worker has finished."""
        for c in self.children:
            if c.role in SERVER_ROLES:
                _signal_group(c.proc, signal.SIGTERM)
        for c in self.children:
            if c.role in SERVER_ROLES:
                try:
                    c.proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal_group(c.proc, signal.SIGKILL)
                    c.proc.wait(timeout=GRACE_S)

    def _token_env(self, wid: str) -> dict:
        """The launch token of worker ``wid`` (the same for its restarts), for its Register."""
        return {TOKEN_ENV: self.tokens[wid]} if wid in self.tokens else {}

    def _spawn(self, cmd: list, log_path: Path, env: dict) -> Launched:
        """Start one process through the launcher (on the node the placement gives that worker)."""
        name = log_path.stem
        slot = getattr(self, "placement", {}).get(name)
        return self.launcher.start(name, cmd, env, log_path, node=slot.node if slot is not None else 0)

    def _write_pids(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children} | {"supervisor": os.getpid()}
        pids["placement"] = {name: slot.as_dict() for name, slot in self.placement.items()}
        tmp = self.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps(pids, indent=2))
        tmp.replace(self.run_dir / "pids.json")

    # ---- watching ------------------------------------------------------------------------
    def watch(self, poll_s: float = 0.25) -> int:
        last_line = ""
        while True:
            if self._signal is not None:
                self.stop_all()
                return 128 + self._signal
            failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
            if failed and self._no_restart(failed[0]) is None:
                self._restart(failed[0])
                continue
            if failed:
                return self._fail(failed[0])
            if all(c.proc.poll() == 0 for c in self.children if c.role not in SERVER_ROLES):
                self._stop_servers()
                self._progress_done(last_line)
                return 0
            if self._lingering_after_run_end():
                self._progress_done(last_line)
                return 0
            last_line = self._progress(last_line)
            time.sleep(poll_s)

    def _scheduler_done(self) -> bool:
        return any(c.name == "scheduler" and c.proc.poll() == 0 for c in self.children)

    def _no_restart(self, dead: Child) -> Optional[str]:
        """Why this dead worker is not restarted, or None if it is."""
        if dead.role not in RESTARTABLE:
            return f"a {dead.role} worker is never restarted"
        if self._scheduler_done():
            return "the run had ended"
        if dead.role not in SERVER_ROLES and (blocker := restart_blocker(self.cfg)):
            return blocker
        if dead.restarts >= self.cfg.cluster.max_restarts:
            return f"{dead.restarts} restart(s) used"
        return None

    def _lingering_after_run_end(self) -> bool:
        """True (after stopping them) when workers still run RUN_END_GRACE_S after the scheduler
        finished the run: e.g. one restarted too late to be told to shut down."""
        if not self._scheduler_done():
            self._run_end_seen = None
            return False
        now = time.monotonic()
        self._run_end_seen = self._run_end_seen or now
        if now - self._run_end_seen < RUN_END_GRACE_S:
            return False
        left = [c.name for c in self.children if c.proc.poll() is None]
        print(f"\n[areal-async] the run finished, but {', '.join(left)} still ran {RUN_END_GRACE_S:.0f}s after the "
              "scheduler exited; stopping them", file=sys.stderr)
        self.stop_all()
        return True

    def _restart(self, dead: Child) -> None:
        """Start the same command again: the new process registers under the same id, and the
        scheduler re-issues what the old one held (see scheduler/service.py)."""
        old_pid = dead.proc.pid
        _signal_group(dead.proc, signal.SIGKILL)  # whatever the dead worker left in its group (reward checks)
        dead.restarts += 1
        print(f"\n[areal-async] worker {dead.name} (pid {old_pid}) {_how(dead.proc.returncode)}; restarting it "
              f"({dead.restarts}/{self.cfg.cluster.max_restarts}). Last lines of {dead.log_path}:", file=sys.stderr)
        for line in tail(dead.log_path, 5):
            print("  | " + line, file=sys.stderr)
        with open(dead.log_path, "a") as log:
            log.write(f"\n----- restarted by the supervisor ({dead.restarts}/{self.cfg.cluster.max_restarts}) -----\n")
        dead.proc = self._spawn(dead.cmd, dead.log_path, dead.env or self._env)
        self._write_pids()

    def _fail(self, dead: Child) -> int:
        self.stop_all()
        why = "" if dead.role not in RESTARTABLE else f" (no restart: {self._no_restart(dead)})"
        print(f"\n[areal-async] worker {dead.name} (pid {dead.proc.pid}) {_how(dead.proc.returncode)}; the run "
              f"failed{why}. Last lines of {dead.log_path}:", file=sys.stderr)
        for line in tail(dead.log_path, 30):
            print("  | " + line, file=sys.stderr)
        return 1

    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after GRACE_S; reap all."""
        for c in self.children:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            _signal_group(c.proc, signal.SIGKILL)  # the group too: a worker's own children
            try:
                c.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"[areal-async] pid {c.proc.pid} ({c.name}) did not die", file=sys.stderr)

    def on_signal(self, signum: int, frame) -> None:
        self._signal = signum

    def cleanup(self) -> None:
        """Remove the run's sockets and any shared-memory segment a killed worker left behind."""
        ep = getattr(self, "endpoints", None)
        if ep is None:
            return
        if ep.sock_dir:
            shutil.rmtree(ep.sock_dir, ignore_errors=True)
        run_id = ep.extra.get("run_id")
        for seg in Path("/dev/shm").glob(f"areal_{run_id}_*") if run_id else []:
            seg.unlink(missing_ok=True)

    # ---- progress ------------------------------------------------------------------------
    def _progress(self, last: str) -> str:
        if not self.progress:
            return last
        row = last_metrics(self.run_dir / "metrics.jsonl")
        if row is None:
            line = f"[areal-async] starting fleet ({time.time() - self.t0:5.1f}s)"
        else:
            line = (f"[areal-async] step {row['step'] + 1}/{self.cfg.total_train_steps}  v{row['version']}  "
                    f"reward {row['reward_mean']:.3f}  staleness<={row['staleness_max']}  "
                    f"{row.get('samples_trained_total', 0) / max(1e-9, row['wall_s']):6.1f} samples/s  "
                    f"{row['wall_s']:6.1f}s")
        if line != last and (row is not None or sys.stdout.isatty()):
            # a terminal gets one live line; a log file gets one line per step
            sys.stdout.write("\r" + line.ljust(100) if sys.stdout.isatty() else line + "\n")
            sys.stdout.flush()
        return line

    def _progress_done(self, last: str) -> None:
        if self.progress and last:
            self._progress(last)
            if sys.stdout.isatty():
                sys.stdout.write("\n")


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _signal_group(proc: Launched, sig: int) -> None:
    """``sig`` to the process and everything it started (its launcher knows how)."""
    proc.signal(sig)


def tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError as e:
        return [f"(cannot read log: {e})"]


def last_metrics(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "kind" not in row:  # a trainer step's row (evaluation rows have kind 'eval')
            return row
    return None


def run_local(cfg: ExperimentConfig, run_dir: str | Path, progress: Optional[bool] = None,
              launcher: Optional[Launcher] = None) -> int:
    """Run the fleet under this supervisor; ``launcher`` starts its processes (default: local children)."""
    sup = LocalSupervisor(cfg, run_dir, progress, launcher)
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            sup.prepare()
        except LaunchError as e:
            print(f"areal-async: {e}", file=sys.stderr)
            return 2
        sup.start_all()
        code = sup.watch()
    except BaseException:
        sup.stop_all()
        raise
    finally:
        sup.cleanup()
        sup.launcher.close()
        for s, h in old.items():
            signal.signal(s, h)
    summary = sup.run_dir / "summary.json"
    if code == 0 and summary.exists():
        print(f"[areal-async] done: {summary.read_text().strip()}")
    return code
