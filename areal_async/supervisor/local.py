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
- a worker the scheduler declared lost (``RUN_DIR/lost.jsonl``)  -> it was told to exit; if it
  still runs LOST_KILL_GRACE_S later it is killed, and then handled as dead (above);
- no trainer step for ``cluster.step_timeout_s`` (the step watchdog) -> a failure that names the
  role whose work is overdue (the oldest unfinished work and its holder, ``scheduler/overdue.py``)
  and what everyone waited for (from the scheduler's ``RUN_DIR/status.json``);
- a worker that exits BUILD_FAILED_EXIT_CODE (its build failed on an import, a config value, a
  missing file: base/process.py)                               -> never restarted nor recovered: the
  run fails at once with the worker's one-line reason;
- a failure with ``recover.retries`` left                     -> in-run recovery: every child is
  stopped and the fleet is relaunched from the newest complete checkpoint (as a rerun with
  ``recover.mode=auto`` would be: the same exactly-once books); summary.json counts recoveries.
  The budget counts recoveries in a row without progress: a fleet that saved a newer complete
  checkpoint before it failed starts the count again (a run of days survives many independent
  faults; a crash loop does not go on for ever);
- SIGINT / SIGTERM to the supervisor                          -> the scheduler is asked (SIGUSR1)
  for a final checkpoint after the step in progress, for at most ``saver.final_grace_s``; then
  every child it started is stopped (SIGTERM to its process group, SIGKILL after a grace
  period), exit 130 / 143. A second signal stops everything at once.

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
from areal_async.base.endpoints import NODE_HOST_ENV, plan_endpoints
from areal_async.base.private import private_dir
from areal_async.base.process import BUILD_FAILED_EXIT_CODE, BUILD_FAILED_MARK
from areal_async.base.runkeys import TOKEN_ENV, write_run_keys, write_server_key
from areal_async.config import ExperimentConfig, to_yaml
from areal_async.supervisor.launchers import Launched, Launcher, LocalLauncher
from areal_async.rollout.server_auth import API_KEY_ENV
from areal_async.supervisor.servers import (
    SERVER_ROLES,
    launch_blocker,
    plan_server_addresses,
    server_commands,
    server_key_env,
)
from areal_async.supervisor.placement import (
    PlacementError,
    Slot,
    check_gpus_present,
    local_gpu_count,
    place,
    shape_of,
    trainer_names,
)
from areal_async.scheduler.overdue import overdue
from areal_async.trainer.checkpoint_dirs import checkpoint_to_resume, latest_complete_checkpoint

GRACE_S = 5.0
RUN_END_GRACE_S = 30.0  # how long workers may outlive a scheduler that finished the run
LOST_KILL_GRACE_S = 3.0  # how long a worker declared lost may take to exit before it is killed


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
    lost: str = ""  # why the scheduler declared this process lost ("" when it was not)
    kill_at: Optional[float] = None  # monotonic time to kill it if it is still running (lost)

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


def device_placement(
    cfg: ExperimentConfig, gpus_here: Optional[int] = None, environ: Optional[dict] = None
) -> dict[str, Slot]:
    """Every process's devices (supervisor/placement.py), mapped through this process's
    CUDA_VISIBLE_DEVICES; LaunchError before anything starts when the cluster or this machine (node 0,
    the local launcher's) has fewer GPUs than asked or the layout is one NCCL or the servers refuse."""
    try:
        placement = place(shape_of(cfg, environ))
        if cfg.cluster.device == "cuda":
            check_gpus_present(placement, 0, local_gpu_count(environ) if gpus_here is None else gpus_here)
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
    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: str | Path,
        progress: Optional[bool] = None,
        launcher: Optional[Launcher] = None,
    ):
        self.cfg, self.run_dir = cfg, Path(run_dir).resolve()
        self.launcher = launcher or LocalLauncher()
        self.progress = cfg.stats_logger.progress if progress is None else progress
        self.children: list[Child] = []
        self.placement: dict[str, Slot] = {}  # worker id -> devices, set by prepare()
        self.t0 = time.time()
        self._signal: Optional[int] = None
        self._n_signals = 0
        self._run_end_seen: Optional[float] = None  # when the scheduler was first seen exited 0
        self.tokens: dict[str, str] = {}  # worker id -> launch token (written by prepare)
        self.recoveries = 0
        self.recoveries_in_a_row = 0  # without a newer complete checkpoint in between
        self._recovered_from: Optional[int] = None  # newest checkpoint step at the last recovery
        self.restarts_total = 0
        self._lost_offset = 0  # bytes of lost.jsonl already read
        self._reset_watchdog()

    # ---- set-up --------------------------------------------------------------------------
    def prepare(self) -> None:
        check_placement(self.cfg)
        if why := launch_blocker(self.cfg):
            raise LaunchError(why)
        self.placement = device_placement(self.cfg)
        resume = self.resume_point()
        private_dir(self.run_dir)  # 0700: checkpoints in it are unpickled on resume (base/private.py)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        cl = self.cfg.cluster  # built-in reward workers bind the first endpoints, bring-your-own ones the rest
        self.endpoints = plan_endpoints(
            cl.n_reward_workers + cl.n_external_reward_workers, self.node_host(None), cl.control, self.node_hosts()
        )
        self.endpoints.extra["resume_from"] = str(resume) if resume else None
        self.endpoints.extra["servers"] = plan_server_addresses(self.cfg)
        # keys before endpoints.json: whoever finds the endpoints finds the keys (bring-your-own workers)
        self.tokens = write_run_keys(
            self.run_dir, {wid: module.rsplit(".", 1)[-1] for wid, module, _ in worker_specs(self.cfg)}
        )
        self.server_env = server_key_env(self.cfg)  # the servers' per-fleet key: theirs and the rollout workers'
        if self.server_env:
            write_server_key(self.run_dir, self.server_env[API_KEY_ENV])
        self.endpoints.extra["recoveries"] = self.recoveries
        self.endpoints.save(self.run_dir)
        if resume:
            print(f"[areal-async] resuming from {resume}")

    def node_host(self, wid: Optional[str]) -> str:
        """The address of the node worker ``wid`` runs on: the launcher's when it places workers itself
        (a multi-node Ray or Slurm run), else ``cluster.node_hosts`` by the placement (node 0 for None)."""
        if wid and (addr := self.launcher.node_address(wid)):
            return addr
        slot = self.placement.get(wid) if wid else None
        return self.cfg.cluster.hosts()[slot.node if slot is not None else 0]

    def node_hosts(self) -> dict[str, str]:
        """Worker id -> the address of its node, for every placed worker."""
        return {wid: self.node_host(wid) for wid in self.placement}

    def resume_point(self) -> Optional[Path]:
        """The newest complete checkpoint to resume from, per recover.mode; refuses to mix runs."""
        books = self.run_dir / "metrics.jsonl"
        if self.cfg.recover.mode == "disabled" and books.exists() and books.stat().st_size > 0:
            raise LaunchError(
                f"{self.run_dir} already holds a run (metrics.jsonl); use a new --run-dir "
                "or recover.mode=auto to continue it"
            )
        try:
            return checkpoint_to_resume(self.run_dir / "checkpoints", self.cfg.recover.mode)
        except ValueError as e:
            raise LaunchError(str(e)) from None

    def start_all(self) -> None:
        env = dict(
            os.environ,
            AREAL_T0=repr(self.t0),
            OMP_NUM_THREADS=str(self.cfg.cluster.torch_threads),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        self._start_servers(env)
        for wid, module, idx in worker_specs(self.cfg):
            log_path = self.run_dir / "logs" / f"{wid}.log"
            cmd = [
                sys.executable,
                "-m",
                module,
                "--run-dir",
                str(self.run_dir),
                "--worker-id",
                wid,
                "--index",
                str(idx),
            ]
            if cpus := getattr(self.cfg.cluster.cpu_affinity, module.rsplit(".", 1)[-1]):
                cmd += ["--cpus", cpus]
            child_env = env | device_env(self.cfg, self.placement.get(wid)) | self._token_env(wid) | self._host_env(wid)
            if module.endswith(".rollout"):
                child_env |= self.server_env
            self.children.append(Child(wid, self._spawn(cmd, log_path, child_env), log_path, cmd, env=child_env))
        self._env = env
        self._write_pids()

    def _start_servers(self, env: dict) -> None:
        """The rollout backend's inference servers (sglang, vllm), before the workers that use them."""
        key = self.server_env.get(API_KEY_ENV, "")
        for name, cmd in server_commands(self.cfg, self.run_dir, self.endpoints.extra["servers"], key):
            log_path = self.run_dir / "logs" / f"{name}.log"
            server_env = env | self.server_env | device_env(self.cfg, self.placement.get(name))  # its own GPUs
            self.children.append(Child(name, self._spawn(cmd, log_path, server_env), log_path, cmd, env=server_env))

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

    def _host_env(self, wid: str) -> dict:
        """With cluster.node_hosts: the address of the worker's node (it binds and connects from it)."""
        placed = self.cfg.cluster.node_hosts or self.launcher.node_address(wid)
        return {NODE_HOST_ENV: self.node_host(wid)} if placed else {}

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
                return self._stop_on_signal()
            self._kill_lost()
            failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
            if failed and self._no_restart(failed[0]) is None:
                self._restart(failed[0])
                continue
            silent = None if failed else self._watchdog()
            if failed or silent:
                if self._recover_or_fail(failed[0] if failed else None, silent):
                    continue
                return 1
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
        if dead.proc.returncode == BUILD_FAILED_EXIT_CODE:
            return build_failure(dead.log_path)
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
        print(
            f"\n[areal-async] the run finished, but {', '.join(left)} still ran {RUN_END_GRACE_S:.0f}s after the "
            "scheduler exited; stopping them",
            file=sys.stderr,
        )
        self.stop_all()
        return True

    def _restart(self, dead: Child) -> None:
        """Start the same command again: the new process registers under the same id, and the
        scheduler re-issues what the old one held (see scheduler/service.py)."""
        old_pid = dead.proc.pid
        _signal_group(dead.proc, signal.SIGKILL)  # whatever the dead worker left in its group (reward checks)
        dead.restarts += 1
        self.restarts_total += 1
        dead.lost, dead.kill_at = "", None
        print(
            f"\n[areal-async] worker {dead.name} (pid {old_pid}) {_how(dead.proc.returncode)}; restarting it "
            f"({dead.restarts}/{self.cfg.cluster.max_restarts}). Last lines of {dead.log_path}:",
            file=sys.stderr,
        )
        for line in tail(dead.log_path, 5):
            print("  | " + line, file=sys.stderr)
        with open(dead.log_path, "a") as log:
            log.write(f"\n----- restarted by the supervisor ({dead.restarts}/{self.cfg.cluster.max_restarts}) -----\n")
        dead.proc = self._spawn(dead.cmd, dead.log_path, dead.env or self._env)
        self._write_pids()

    def _recover_or_fail(self, dead: Optional[Child], silent: Optional[str]) -> bool:
        """Report the failure (a dead child, or the watchdog's finding); relaunch the fleet when
        recover.retries allows (True), else stop everything (False: the run failed)."""
        self.stop_all()
        newest = self._newest_checkpoint_step()
        if self._recovered_from is not None and newest > self._recovered_from:
            self.recoveries_in_a_row = 0  # the fleet made progress since the last recovery
        build_failed = dead is not None and dead.proc.returncode == BUILD_FAILED_EXIT_CODE
        recover = self.recoveries_in_a_row < self.cfg.recover.retries and not build_failed
        outcome = (
            f"recovering the run ({self.recoveries_in_a_row + 1}/{self.cfg.recover.retries} in a row, "
            f"{self.recoveries + 1} in all) from the newest complete checkpoint"
            if recover
            else "the run failed"
            + (
                f" ({self.recoveries_in_a_row} recoveries in a row without a newer checkpoint)"
                if self.cfg.recover.retries
                else ""
            )
        )
        if build_failed:
            outcome = "the run failed at once"  # neither a restart nor a recovery can fix it
        if dead is None:
            print(f"\n[areal-async] {silent}; {outcome}.", file=sys.stderr)
        else:
            self._report_dead(dead, outcome)
        if recover:
            self._relaunch()
        return recover

    def _report_dead(self, dead: Child, outcome: str) -> None:
        why = [f"declared lost by the scheduler: {dead.lost}"] if dead.lost else []
        if dead.role in RESTARTABLE or dead.proc.returncode == BUILD_FAILED_EXIT_CODE:
            why.append(f"no restart: {self._no_restart(dead)}")
        why_s = f" ({'; '.join(why)})" if why else ""
        print(
            f"\n[areal-async] worker {dead.name} (pid {dead.proc.pid}) {_how(dead.proc.returncode)}; {outcome}"
            f"{why_s}. Last lines of {dead.log_path}:",
            file=sys.stderr,
        )
        for line in tail(dead.log_path, 30):
            print("  | " + line, file=sys.stderr)

    def _relaunch(self) -> None:
        """In-run recovery: a fresh fleet from the newest complete checkpoint (recover.mode=auto
        rolls the books back to it), with the same run directory and clock."""
        self.recoveries += 1
        self.recoveries_in_a_row += 1
        self._recovered_from = self._newest_checkpoint_step()
        self.cleanup()
        self.children = []
        if self.cfg.recover.mode == "disabled":
            self.cfg = dataclasses.replace(self.cfg, recover=dataclasses.replace(self.cfg.recover, mode="auto"))
        self.prepare()
        self._reset_watchdog()
        self.start_all()

    def _newest_checkpoint_step(self) -> int:
        path = latest_complete_checkpoint(self.run_dir / "checkpoints")
        return -1 if path is None else int(path.name.split("_")[1])

    # ---- liveness ------------------------------------------------------------------------
    def _kill_lost(self) -> None:
        """Read the scheduler's new lost.jsonl lines; a lost worker still running after
        LOST_KILL_GRACE_S (it was told to exit) is killed, so it can never send live work again."""
        for rec in self._new_lost_records():
            c = next((c for c in self.children if c.name == rec.get("worker")), None)
            if c is not None and c.proc.pid == rec.get("pid") and c.proc.poll() is None:
                c.lost, c.kill_at = str(rec.get("why", "")), time.monotonic() + LOST_KILL_GRACE_S
        for c in self.children:
            if c.kill_at is not None and time.monotonic() >= c.kill_at and c.proc.poll() is None:
                print(
                    f"\n[areal-async] worker {c.name} (pid {c.proc.pid}) was declared lost ({c.lost}) and still "
                    f"runs {LOST_KILL_GRACE_S:.0f}s later; killing it",
                    file=sys.stderr,
                )
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait(timeout=GRACE_S)
                c.kill_at = None

    def _new_lost_records(self) -> list[dict]:
        path = self.run_dir / "lost.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._lost_offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._lost_offset += len(complete)
        out = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def _reset_watchdog(self) -> None:
        self._fleet_t = time.monotonic()
        self._last_step_t: Optional[float] = None  # None until the trainer of this fleet is ready
        self._metrics_size = -1
        (self.run_dir / "status.json").unlink(missing_ok=True)  # a previous fleet's scheduler wrote it

    def _watchdog(self) -> Optional[str]:
        """The step watchdog: why the run is stuck (no trainer step for cluster.step_timeout_s
        once the trainer was ready; before that, no word from the scheduler as long), or None."""
        limit = self.cfg.cluster.step_timeout_s
        if limit <= 0 or self._scheduler_done():
            return None
        now = time.monotonic()
        size = _size(self.run_dir / "metrics.jsonl")
        status, age = read_status(self.run_dir / "status.json")
        if self._last_step_t is None:  # starting (model load, SFT warm-up, a resume's rollback)
            if status is not None and status.get("trainer_ready"):
                self._last_step_t, self._metrics_size = now, size  # the clock starts when the trainer is ready
                return None
            if now - self._fleet_t < limit or (age is not None and age < limit):
                return None  # the scheduler reports on time
            return silence_report(status, age, now - self._fleet_t, self.cfg)
        if size != self._metrics_size:
            self._metrics_size, self._last_step_t = size, now
        since = self._last_step_t
        if now - since < limit:
            return None
        return silence_report(status, age, now - since, self.cfg)

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
        self._n_signals += 1

    def _stop_on_signal(self) -> int:
        """SIGINT/SIGTERM: a final checkpoint (at most saver.final_grace_s), then stop everyone."""
        sig, grace = self._signal, self.cfg.saver.final_grace_s
        sched = next((c for c in self.children if c.name == "scheduler" and c.proc.poll() is None), None)
        if grace > 0 and sched is not None:
            print(
                f"\n[areal-async] signal {sig}: saving a final checkpoint after the step in progress (at most "
                f"{grace:g}s; signal again to stop at once)",
                file=sys.stderr,
            )
            sched.proc.signal(signal.SIGUSR1)  # its launcher signals the scheduler process (it starts nothing)
            deadline = time.monotonic() + grace
            while (
                time.monotonic() < deadline
                and self._n_signals < 2
                and any(c.proc.poll() is None for c in self.children)
            ):
                time.sleep(0.1)
            done = sched.proc.poll() == 0
            print(
                f"[areal-async] {'final checkpoint saved; ' if done else 'no final checkpoint in time; '}"
                "stopping every process",
                file=sys.stderr,
            )
        self.stop_all()
        return 128 + sig

    def annotate_summary(self) -> None:
        """Add the supervisor's counts to summary.json: worker restarts and fleet recoveries."""
        path = self.run_dir / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        summary.update(restarts=self.restarts_total, recoveries=self.recoveries)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)

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
            line = (
                f"[areal-async] step {row['step'] + 1}/{self.cfg.total_train_steps}  v{row['version']}  "
                f"reward {row['reward_mean']:.3f}  staleness<={row['staleness_max']}  "
                f"{row.get('samples_trained_total', 0) / max(1e-9, row['wall_s']):6.1f} samples/s  "
                f"{row['wall_s']:6.1f}s"
            )
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


def read_status(path: Path) -> tuple[Optional[dict], Optional[float]]:
    """The scheduler's status.json and its age in seconds (None, None when missing or unreadable)."""
    try:
        age = time.time() - path.stat().st_mtime
        return json.loads(path.read_text()), age
    except (OSError, json.JSONDecodeError):
        return None, None


def silence_report(status: Optional[dict], age: Optional[float], silent_s: float, cfg: ExperimentConfig) -> str:
    """Whose work is overdue (the oldest unfinished work and its holder, ``scheduler/overdue.py``) and what
    every worker waits for, from the scheduler's status; the scheduler itself when its status is stale."""
    head = f"no trainer step for {silent_s:.0f}s (cluster.step_timeout_s={cfg.cluster.step_timeout_s:g})"
    if status is None or age is None or age > max(5.0, 3 * cfg.cluster.heartbeat_s):
        return f"{head}: overdue: scheduler (its status.json is {'missing' if age is None else f'{age:.0f}s old'})"
    workers = status.get("workers", {})
    others = "; ".join(
        f"{wid} waits for {w.get('waiting_for') or '?'} (heartbeat {w.get('silent_s')}s ago)"
        for wid, w in sorted(workers.items())
    )
    who = overdue(status, cfg.cluster.heartbeat_s)
    return f"{head}: overdue: {who}. The scheduler waits for {status.get('waiting_for')}. {others}"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _signal_group(proc: Launched, sig: int) -> None:
    """``sig`` to the process and everything it started (its launcher knows how)."""
    proc.signal(sig)


def build_failure(log_path: Path) -> str:
    """Why a worker that exited BUILD_FAILED_EXIT_CODE failed: its log's last BUILD_FAILED_MARK line."""
    marked = [line.split(BUILD_FAILED_MARK, 1)[1] for line in tail(log_path, 40) if BUILD_FAILED_MARK in line]
    why = marked[-1] if marked else "see its log"
    return f"it failed to build ({why}), which no restart can fix"


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


def run_local(
    cfg: ExperimentConfig, run_dir: str | Path, progress: Optional[bool] = None, launcher: Optional[Launcher] = None
) -> int:
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
        sup.annotate_summary()
        print(f"[areal-async] done: {summary.read_text().strip()}")
    return code
