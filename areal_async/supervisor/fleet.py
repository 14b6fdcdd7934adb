"""The supervisor: starts a fleet, watches it until the run ends, restarts, recovers and stops it.

``run_fleet(cfg, run_dir, progress, launcher)`` is the whole life of one run, whatever starts the
processes (``launchers.py``: local children by default; ``slurm.py`` hands it srun steps,
``ray_launcher.py`` Ray actors). ``Supervisor.prepare`` checks the plan (``plan.py``: pinned CPUs,
servers, placement) and writes the run directory (``rundir.py``); ``start_all`` starts the inference
servers, then the scheduler, reward workers, trainer ranks and rollout workers (each in its own
process group, logging to ``RUN_DIR/logs/<worker>.log``; those the fork server starts after the others,
``Launcher.waits``); ``watch`` then decides:

- all children exit 0 after the scheduler's Shutdown          -> the run succeeded (exit 0);
- a rollout or reward worker exits non-zero (or dies by a signal) -> it is restarted with the
  same command, up to ``cluster.max_restarts`` times each (zmq/shm tensor channels only: a
  gloo/NCCL group cannot take in a new process; ``plan.why_no_restart``); the scheduler re-issues
  the work it held;
- any other child dies, or restarts are used up / impossible  -> the run fails loudly: the dead
  worker's last log lines are printed (``report.py``), every other child is stopped, exit 1;
- a worker the scheduler declared lost (``RUN_DIR/lost.jsonl``)  -> it was told to exit; if it
  still runs LOST_KILL_GRACE_S later it is killed, and then handled as dead (above);
- no trainer step for ``cluster.step_timeout_s`` (``watchdog.StepWatchdog``) -> a failure that names
  the role whose work is overdue and what everyone waited for;
- a worker that exits BUILD_FAILED_EXIT_CODE (its build failed on an import, a config value, a
  missing file, or its loop met an ``Unfixable`` error: base/process.py), or an inference server whose
  log shows it refused its configuration at start (``report.server_config_error``)
                                                               -> never restarted nor recovered: the
  run fails at once with the one-line reason;
- a failure with ``recover.retries`` left                     -> in-run recovery: every child is
  stopped and the fleet is relaunched from the newest complete checkpoint (as a rerun with
  ``recover.mode=auto`` would be: the same exactly-once books); summary.json counts recoveries.
  The budget counts recoveries in a row without progress (``plan.recovery_verdict``): a fleet that
  saved a newer complete checkpoint before it failed starts the count again;
- SIGINT / SIGTERM / SIGHUP to the supervisor                 -> the scheduler is asked (SIGUSR1)
  for a final checkpoint after the step in progress, for at most ``saver.final_grace_s``; then
  every child it started is stopped (SIGTERM to its process group, SIGKILL after a grace
  period), exit 130 / 143 / 129. A second signal stops everything at once. SIGHUP is the terminal
  closing: the workers run in sessions of their own, so they never see it, and a supervisor that died of
  it would leave them running with nobody to watch or stop them. Under ``nohup`` (SIGHUP ignored when
  the supervisor started) it stays ignored.

It only ever signals the pids it started (and their process groups), never by name. A live
progress line is drawn from ``metrics.jsonl`` (``progress.py``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_async.base.process import BUILD_FAILED_EXIT_CODE
from areal_async.config import ExperimentConfig
from areal_async.supervisor.forkserver import worker_env
from areal_async.supervisor.launchers import Launched, Launcher, LocalLauncher
from areal_async.supervisor.memory import PeakRss
from areal_async.supervisor.placement import Slot
from areal_async.supervisor.plan import (
    RESTARTABLE,
    LaunchError,
    check_placement,
    device_env,
    device_placement,
    recovery_verdict,
    why_no_restart,
    worker_command,
    worker_specs,
)
from areal_async.supervisor.progress import ProgressLine
from areal_async.supervisor.report import build_failure, finish, server_config_error, tell_dead
from areal_async.supervisor.rundir import Nodes, RunDir, remove_run_files, write_pids, write_run_dir
from areal_async.supervisor.servers import SERVER_ROLES, launch_blocker, server_commands
from areal_async.supervisor.watchdog import StepWatchdog, capture_hang, lost_log
from areal_async.trainer.persist.checkpoint_dirs import latest_complete_checkpoint

GRACE_S = 5.0
RUN_END_GRACE_S = 30.0  # how long workers may outlive a scheduler that finished the run
LOST_KILL_GRACE_S = 3.0  # how long a worker declared lost may take to exit before it is killed
ENDING_POLL_S = 0.02  # the watch's poll once a child has exited: the others of a finished run follow within ms


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


class Supervisor:
    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: str | Path,
        progress: Optional[bool] = None,
        launcher: Optional[Launcher] = None,
    ):
        self.cfg, self.run_dir = cfg, Path(run_dir).resolve()
        self.launcher = launcher or LocalLauncher()
        self.children: list[Child] = []
        self.placement: dict[str, Slot] = {}  # worker id -> devices, set by prepare()
        self.rundir: Optional[RunDir] = None  # what prepare() wrote
        self.t0 = time.time()
        self._env: dict = {}  # the environment every child starts from (set by start_all)
        self._signal: Optional[int] = None
        self._n_signals = 0
        self._run_end_seen: Optional[float] = None  # when the scheduler was first seen exited 0
        self.recoveries = 0
        self.recoveries_in_a_row = 0  # without a newer complete checkpoint in between
        self._recovered_from: Optional[int] = None  # newest checkpoint step at the last recovery
        self.restarts_total = 0
        self.lost = lost_log(self.run_dir)
        self.watchdog = StepWatchdog(cfg, self.run_dir, self._scheduler_done)
        self.rss = PeakRss()
        show = cfg.stats_logger.progress if progress is None else progress
        self.progress = ProgressLine(self.run_dir / "metrics.jsonl", cfg.total_train_steps, self.t0, show)
        self.tty_fds = tuple(fd for fd in (1, 2) if os.isatty(fd))  # the terminal it runs in, if any (SIGHUP)

    # ---- start ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the plan and write the run directory; LaunchError before anything starts."""
        check_placement(self.cfg)
        if why := launch_blocker(self.cfg):
            raise LaunchError(why)
        self.placement = device_placement(self.cfg)
        self.nodes = Nodes(self.cfg, self.placement, self.launcher.node_address)
        self.rundir = write_run_dir(self.cfg, self.run_dir, self.nodes, self.recoveries)

    def start_all(self) -> None:
        """The inference servers, then every worker in start order, those whose start may wait for the
        launcher (``Launcher.waits``: the fork server's imports) after the others; then pids.json."""
        self._env = worker_env(self.cfg) | {"AREAL_T0": repr(self.t0)}
        rd = self.rundir
        for name, cmd in server_commands(self.cfg, self.run_dir, rd.manifest.servers, rd.server_key):
            self._start(name, cmd, self._env | rd.server_env | device_env(self.cfg, self.placement.get(name)))
        workers = []
        for spec in worker_specs(self.cfg):
            env = self._env | device_env(self.cfg, self.placement.get(spec.wid))
            env |= rd.token_env(spec.wid) | self.nodes.env(spec.wid)
            if spec.role == "rollout":
                env |= rd.server_env
            workers.append((spec.wid, worker_command(self.cfg, self.run_dir, spec), env))
        for wid, cmd, env in sorted(workers, key=lambda w: self.launcher.waits(w[1], w[2])):  # a stable sort
            self._start(wid, cmd, env)
        write_pids(self.run_dir, {c.name: c.proc.pid for c in self.children}, self.placement)
        self.watchdog.started()

    def _start(self, name: str, cmd: list, env: dict) -> None:
        log_path = self.run_dir / "logs" / f"{name}.log"
        self.children.append(Child(name, self._spawn(cmd, log_path, env), log_path, cmd, env=env))

    def _spawn(self, cmd: list, log_path: Path, env: Optional[dict]) -> Launched:
        """Start one process through the launcher (on the node the placement gives that worker)."""
        slot = self.placement.get(log_path.stem)
        return self.launcher.start(log_path.stem, cmd, env, log_path, node=slot.node if slot is not None else 0)

    # ---- watch ---------------------------------------------------------------------------
    def watch(self, poll_s: float = 0.25) -> int:
        """Until the run ends: 0 (it succeeded), 1 (it failed), 128 + signal (stopped by one). Every ``poll_s``
        while every child runs, every ENDING_POLL_S once one has exited."""
        while True:
            if self._signal is not None:
                return self._stop_on_signal()
            self._kill_lost()
            failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
            if failed and self._no_restart(failed[0]) is None:
                self._restart(failed[0])
                continue
            silent = None if failed else self.watchdog.check()
            if silent:  # the stacks of every role into the run directory before acting
                capture_hang(self.run_dir, {c.name: c.proc for c in self.children}, silent)
            if failed or silent:
                if self._recover_or_fail(failed[0] if failed else None, silent):
                    continue
                return 1
            if all(c.proc.poll() == 0 for c in self.children if c.role not in SERVER_ROLES):
                self._stop_servers()
                self.progress.done()
                return 0
            if self._lingering_after_run_end():
                self.progress.done()
                return 0
            self.progress.draw()
            self.rss.sample(self.children)
            ending = any(c.proc.poll() is not None for c in self.children)  # the run's end (or a failure) is near
            time.sleep(min(poll_s, ENDING_POLL_S) if ending else poll_s)

    def _scheduler_done(self) -> bool:
        return any(c.name == "scheduler" and c.proc.poll() == 0 for c in self.children)

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

    def _kill_lost(self) -> None:
        """Read the scheduler's new lost.jsonl lines; a lost worker still running after
        LOST_KILL_GRACE_S (it was told to exit) is killed, so it can never send live work again."""
        for rec in self.lost.read():
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
                c.proc.signal(signal.SIGKILL)
                c.proc.wait(timeout=GRACE_S)
                c.kill_at = None

    # ---- restart, recover ----------------------------------------------------------------
    def _no_restart(self, dead: Child) -> Optional[str]:
        """Why this dead worker is not restarted, or None if it is."""
        return self._unfixable(dead) or why_no_restart(self.cfg, dead.role, dead.restarts, self._scheduler_done())

    @staticmethod
    def _unfixable(dead: Child) -> Optional[str]:
        """Why no restart or recovery can help this dead child, or None: a worker that exited
        BUILD_FAILED_EXIT_CODE, or a server whose log shows it refused its configuration at start."""
        if dead.proc.returncode == BUILD_FAILED_EXIT_CODE:
            return build_failure(dead.log_path)
        return server_config_error(dead.log_path) if dead.role in SERVER_ROLES else None

    def _restart(self, dead: Child) -> None:
        """Start the same command again: the new process registers under the same id, and the
        scheduler re-issues what the old one held (see scheduler/service.py)."""
        old_pid = dead.proc.pid
        dead.proc.signal(signal.SIGKILL)  # whatever the dead worker left in its group (reward checks)
        dead.restarts += 1
        self.restarts_total += 1
        dead.lost, dead.kill_at = "", None
        what = f"restarting it ({dead.restarts}/{self.cfg.cluster.max_restarts})"
        tell_dead(dead.name, old_pid, dead.proc.returncode, what, dead.log_path, 5)
        with open(dead.log_path, "a") as log:
            log.write(f"\n----- restarted by the supervisor ({dead.restarts}/{self.cfg.cluster.max_restarts}) -----\n")
        dead.proc = self._spawn(dead.cmd, dead.log_path, dead.env or self._env)
        write_pids(self.run_dir, {c.name: c.proc.pid for c in self.children}, self.placement)

    def _recover_or_fail(self, dead: Optional[Child], silent: Optional[str]) -> bool:
        """Report the failure (a dead child, or the watchdog's finding); relaunch the fleet when
        recover.retries allows (True), else stop everything (False: the run failed)."""
        self.stop_all()
        newest = self._newest_checkpoint_step()
        if self._recovered_from is not None and newest > self._recovered_from:
            self.recoveries_in_a_row = 0  # the fleet made progress since the last recovery
        build_failed = dead is not None and self._unfixable(dead) is not None
        recover, outcome = recovery_verdict(
            self.recoveries_in_a_row, self.recoveries, self.cfg.recover.retries, build_failed
        )
        if dead is None:
            print(f"\n[areal-async] {silent}; {outcome}.", file=sys.stderr)
        else:
            self._report_dead(dead, outcome)
        if recover:
            self._relaunch()
        return recover

    def _report_dead(self, dead: Child, outcome: str) -> None:
        why = [f"declared lost by the scheduler: {dead.lost}"] if dead.lost else []
        if dead.role in RESTARTABLE or self._unfixable(dead):
            why.append(f"no restart: {self._no_restart(dead)}")
        why_s = f" ({'; '.join(why)})" if why else ""
        tell_dead(dead.name, dead.proc.pid, dead.proc.returncode, outcome + why_s, dead.log_path, 30)

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
        self.watchdog.reset()
        self.start_all()

    def _newest_checkpoint_step(self) -> int:
        path = latest_complete_checkpoint(self.run_dir / "checkpoints")
        return -1 if path is None else int(path.name.split("_")[1])

    # ---- stop ----------------------------------------------------------------------------
    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after GRACE_S; reap all."""
        for c in self.children:
            c.proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            c.proc.signal(signal.SIGKILL)  # the group too: a worker's own children
            try:
                c.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"[areal-async] pid {c.proc.pid} ({c.name}) did not die", file=sys.stderr)

    def _stop_servers(self) -> None:
        """Servers never exit by themselves: stop them once every worker has finished."""
        servers = [c for c in self.children if c.role in SERVER_ROLES]
        for c in servers:
            c.proc.signal(signal.SIGTERM)
        for c in servers:
            try:
                c.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                c.proc.signal(signal.SIGKILL)
                c.proc.wait(timeout=GRACE_S)

    def on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            _detach_terminal(self.tty_fds)  # its writes would fail (EIO) before the fleet is stopped
        self._signal = signum
        self._n_signals += 1
        self.launcher.interrupt()  # a start waiting on its launcher (the fork server's imports) ends now

    def _stop_on_signal(self) -> int:
        """SIGINT/SIGTERM/SIGHUP: a final checkpoint (at most saver.final_grace_s), then stop everyone."""
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

    def cleanup(self) -> None:
        """Remove the run's sockets and any shared-memory segment a killed worker left behind."""
        if self.rundir is not None:
            remove_run_files(self.rundir.manifest)


def _detach_terminal(fds: tuple[int, ...]) -> None:
    """``fds`` (standard output and error that were a terminal when the run started: a hung-up one no longer
    says it is one) go to /dev/null from now on: the stop that follows prints its lines, and a write to a
    closed terminal fails (EIO). A file or a pipe stays as it is."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a run: SIGINT, SIGTERM, and SIGHUP unless it was ignored when this process
    started (``nohup``: the user asked the run to outlive the terminal)."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hup)


def run_fleet(
    cfg: ExperimentConfig, run_dir: str | Path, progress: Optional[bool] = None, launcher: Optional[Launcher] = None
) -> int:
    """Run the fleet under this supervisor; ``launcher`` starts its processes (default: local children).
    Exit code: 0 the run succeeded, 1 it failed, 2 it could not start, 128 + N stopped by signal N."""
    sup = Supervisor(cfg, run_dir, progress, launcher)
    old = {s: signal.signal(s, sup.on_signal) for s in stop_signals()}
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
    finish(sup.run_dir, code, sup.restarts_total, sup.recoveries, sup.rss.mb(), sup.rss.parts_mb())
    return code
