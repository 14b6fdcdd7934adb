"""``cluster.launcher=ray``: every worker process held by a Ray actor, placed with a placement group.

``RayLauncher(cfg)`` connects to an existing cluster (``cluster.ray_address``, e.g. ``auto`` or
``ray://head:10001``) or starts a local one, and reserves one placement group for the run: one
bundle per worker process (``{"CPU": 1}``; servers, rollout workers and trainer ranks on a GPU run add
their GPUs), packed onto as few nodes as fit (``PACK``) or one bundle set per node
(``cluster.n_nodes`` > 1: ``SPREAD`` across them). ``start`` creates a ``_Holder`` actor in the
worker's bundle, which runs the worker's command as a child process (its own session, log
appended to the run directory, which every node must mount) and reports it back: ``poll`` /
``wait`` / ``signal`` are actor calls. A holder whose actor dies (its node lost) reports the
worker as killed (-9), so the supervisor's rules (restart, fail, stop) apply unchanged. The
launch token travels in the actor call's environment, never on a command line.

Processes that share a GPU (a rollout worker beside the servers it owns; the rollout workers beside trainer
rank 0 under ``cuda_ipc``) share one bundle (``ray_plan``): a bundle lies on one node, and Ray, not the planner,
picks which of that node's GPUs a bundle's actors get. The first process to hold a GPU (in the run's order:
servers before their workers, trainer rank 0 before the workers beside it) owns it and asks Ray for it; a
process that only shares GPUs asks for none and starts with the ids Ray gave their owners (``ray.get_gpu_ids``
in the owner's actor), so it names the same device. Read against Ray's placement-group and ``get_gpu_ids``
semantics and run on a local Ray with logical GPUs (tests/e2e/test_ray_launcher.py); never on real GPUs.

``ray`` is an optional dependency (``pip install -e '.[ray]'``); it is imported here only when a
Ray launcher is built, so the local and Slurm launchers never load it.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_async.config import ExperimentConfig, n_servers, server_addresses
from areal_async.supervisor.launchers import Launched, Launcher, popen_logged
from areal_async.supervisor.plan import device_placement, worker_specs
from areal_async.supervisor.placement import Slot
from areal_async.supervisor.servers import server_role, uses_servers

CALL_TIMEOUT_S = 30.0  # an actor call unanswered this long is asked again later (poll) or times out (wait)
SHUTDOWN_GRACE_S = 30.0  # how long the local Ray's processes may take to exit after ray.shutdown
START_TIMEOUT_S = 300.0  # a new holder actor: Ray starts a Python worker process for it (slow on a loaded node)


class RayLaunchError(RuntimeError):
    """Ray is missing or refused; the message says what to do."""


class _Holder:
    """The Ray actor that holds one worker process (defined plain; ``ray.remote`` wraps it lazily)."""

    def ready(self) -> bool:
        return True

    def gpu_ids(self) -> list[int]:
        """The GPUs Ray gave this actor (its bundle's, as many as it asked for)."""
        import ray

        return [int(g) for g in ray.get_gpu_ids()]

    def start(self, cmd: list[str], env: dict, log_path: str) -> int:
        import ray

        gpu_ids = ray.get_gpu_ids()  # on a GPU run: the devices Ray gave this bundle, not the planner's numbers
        if gpu_ids:
            env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(int(g)) for g in gpu_ids))
        self.proc = popen_logged(cmd, env, Path(log_path))
        return self.proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: Optional[float]) -> Optional[int]:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is not None and sig == 15:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class RayProcess(Launched):
    """A worker process held by a ``_Holder`` actor."""

    def __init__(self, ray, actor, pid: int, name: str):
        self._ray, self.actor, self.pid, self.name = ray, actor, pid, name
        self.returncode: Optional[int] = None

    def _call(self, method: str, *args, timeout: float = CALL_TIMEOUT_S):
        """The holder's answer; the worker's -9 when the holder (or its node) is gone; None when the answer
        is late (a slow node is not a dead one: Ray raises RayActorError once it declares the node dead)."""
        try:
            return self._ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except self._ray.exceptions.RayActorError:
            self.returncode = -9  # the holder (or its node) is gone: the worker with it
            return self.returncode
        except self._ray.exceptions.GetTimeoutError:
            return None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._call("poll")
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is not None:
            return self.returncode
        code = self._call("wait", timeout, timeout=CALL_TIMEOUT_S + (timeout or 0))
        if code is None:
            raise subprocess.TimeoutExpired(self.name, timeout)
        self.returncode = code
        return code

    def signal(self, sig: int) -> None:
        if self.returncode is None or sig != 15:
            self._call("signal", sig)


def bundle_addresses(table: dict, nodes: list[dict], home: dict[str, int]) -> dict[str, str]:
    """Worker name -> the address of the node Ray put its bundle (``home[name]``) on (``placement_group_table(pg)``'s
    ``bundles_to_node_id`` and ``ray.nodes()``' ``NodeID`` / ``NodeManagerAddress``)."""
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
    node_of = {int(k): ip[v] for k, v in table["bundles_to_node_id"].items()}
    return {name: node_of[k] for name, k in home.items()}


@dataclass
class RayPlan:
    """The placement group's bundles and, per worker: its bundle (``home``), the GPUs it asks Ray for (``own``),
    and for a process that only shares GPUs, where each of its GPUs comes from: (owner, index among the owner's)."""

    bundles: list[dict]
    home: dict[str, int]
    own: dict[str, int]
    borrowed: dict[str, list[tuple[str, int]]]


def ray_plan(placement: dict[str, Slot], names: list[str]) -> RayPlan:
    """One bundle per group of processes that share GPUs (one per process otherwise), a CPU per process and each
    distinct GPU once; a GPU's owner is the first of ``names`` that holds it (module docstring)."""
    owner: dict[tuple[int, int], tuple[str, int]] = {}
    own, borrowed = {}, {}
    for name in names:
        s = placement.get(name)
        gpus = [(s.node, g) for g in s.gpus] if s is not None else []
        mine = [k for k in gpus if k not in owner]
        if mine and len(mine) != len(gpus):
            raise RayLaunchError(
                f"{name} would own some of its GPUs and share others {gpus}: not a layout the planner makes"
            )
        owner |= {k: (name, i) for i, k in enumerate(mine)}
        own[name] = len(mine)
        if gpus and not mine:
            borrowed[name] = [owner[k] for k in gpus]
    group = {n: n for n in names}  # union-find: a sharer joins its owners' group

    def root(n: str) -> str:
        while group[n] != n:
            n = group[n]
        return n

    for name, pairs in borrowed.items():
        for o, _ in pairs:
            group[root(o)] = root(name)
    bundles, home, index = [], {}, {}
    for name in names:
        r = root(name)
        if r not in index:
            index[r] = len(bundles)
            bundles.append({"CPU": 0.0})
        k = home[name] = index[r]
        bundles[k]["CPU"] += 1.0
        if own[name]:
            bundles[k]["GPU"] = bundles[k].get("GPU", 0.0) + own[name]
    return RayPlan(bundles, home, own, borrowed)


class RayLauncher(Launcher):
    """Workers as processes held by Ray actors, in one placement group of the run."""

    name = "ray"

    def __init__(
        self,
        names: list[str],
        placement: dict[str, Slot],
        address: str = "",
        n_nodes: int = 1,
        ready_timeout_s: float = 120.0,
    ):
        try:
            import ray
        except ImportError:
            raise RayLaunchError("cluster.launcher=ray needs the ray package: pip install -e '.[ray]'") from None
        self.ray = ray
        self.plan = plan = ray_plan(placement, list(names))
        self._own = not ray.is_initialized()
        self._before = _descendants(os.getpid())  # processes that are not the local Ray's (never reaped)
        if self._own:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:  # a local Ray with room for every bundle (logical CPUs: workers share the real ones)
                _become_subreaper()  # its processes' orphans stay below this process, for close() to reap
                ray.init(
                    num_cpus=len(names), num_gpus=sum(plan.own.values()), include_dashboard=False, log_to_driver=False
                )
        from ray.util.placement_group import placement_group

        self.names = list(names)
        self.pg = placement_group(plan.bundles, strategy="SPREAD" if n_nodes > 1 else "PACK")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RayLaunchError(
                f"the Ray cluster could not place {len(self.names)} bundles "
                f"{plan.bundles} within {ready_timeout_s:.0f}s: "
                f"available {ray.available_resources()}"
            ) from None
        self._addresses: dict[str, str] = {}  # worker name -> its bundle's node address (multi-node runs)
        if n_nodes > 1:
            from ray.util.placement_group import placement_group_table

            self._addresses = bundle_addresses(placement_group_table(self.pg), ray.nodes(), plan.home)
        self._holder = ray.remote(num_cpus=1)(_Holder)
        self.actors: dict[str, object] = {}  # worker name -> its holder (a restart reuses it: same bundle)
        # every holder up front, started in parallel: Ray starts a Python process for each
        holders = [self._new_holder(n) for n in self.names]
        ray.get([h.ready.remote() for h in holders], timeout=START_TIMEOUT_S)

    def _new_holder(self, name: str):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.plan.home[name]
        )
        actor = self._holder.options(
            scheduling_strategy=strategy,
            num_gpus=self.plan.own[name],
            name=f"areal-{name}-{time.monotonic_ns()}",
        ).remote()
        self.actors[name] = actor
        return actor

    def node_address(self, name: str) -> Optional[str]:
        return self._addresses.get(name)

    def start(self, name: str, cmd: list[str], env: dict, log_path: Path, node: int = 0) -> Launched:
        if name not in self.names:
            raise RayLaunchError(f"worker {name!r} has no bundle in this run's placement group ({self.names})")
        if name in self.plan.borrowed:  # its GPUs are its owners': the ids Ray gave them
            env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in self._borrowed_ids(name)))
        try:
            actor = self.actors[name]
            pid = self.ray.get(actor.start.remote(list(cmd), dict(env), str(log_path)), timeout=START_TIMEOUT_S)
        except self.ray.exceptions.RayActorError:  # the holder died with its node: a new one in the same bundle
            actor = self._new_holder(name)
            pid = self.ray.get(actor.start.remote(list(cmd), dict(env), str(log_path)), timeout=START_TIMEOUT_S)
        return RayProcess(self.ray, actor, pid, name)

    def _borrowed_ids(self, name: str) -> list[int]:
        ids = {
            o: self.ray.get(self.actors[o].gpu_ids.remote(), timeout=CALL_TIMEOUT_S)
            for o, _ in self.plan.borrowed[name]
        }
        return [ids[o][i] for o, i in self.plan.borrowed[name]]

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        started = _descendants(os.getpid()) if self._own else set()  # the local Ray's processes
        try:
            remove_placement_group(self.pg)
        finally:
            if self._own:
                self.ray.shutdown()
                _reap(started, SHUTDOWN_GRACE_S, spare=self._before)


def _become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a
    Ray worker whose raylet exits first then stays below the supervisor, where ``_reap`` finds it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init, as before
        pass


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); [] when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below ``root`` (from /proc; the start time tells a reused pid)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and len(f := _stat(int(entry))) > 19:
            children.setdefault(int(f[1]), []).append((int(entry), f[19]))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c[0])
    return out


def _alive(proc: tuple[int, str]) -> bool:
    pid, started = proc
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    f = _stat(pid)
    return len(f) > 19 and f[0] != "Z" and f[19] == started


def _reap(pids: set[tuple[int, str]], grace_s: float, spare: set[tuple[int, str]] = frozenset()) -> None:
    """Wait until the local Ray's processes (``pids``, started for this run) are gone; SIGKILL what is
    left after ``grace_s``: ``ray.shutdown`` ends them asynchronously, and the run must not outlive them.
    Processes in ``spare`` (this process's children from before the local Ray started) are left alone."""
    pids = pids - spare
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        pids = (pids | _descendants(os.getpid())) - spare  # and what they started meanwhile (orphans come here)
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    for p in pids:
        if _alive(p):
            try:
                os.kill(p[0], 9)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def ray_launcher(cfg: ExperimentConfig) -> RayLauncher:
    """The run's Ray launcher: a bundle for every process the supervisor will start (servers included)."""
    ours = uses_servers(cfg) and not server_addresses(cfg)  # servers the supervisor starts itself
    names = [f"{server_role(cfg)}-{j}" for j in range(n_servers(cfg) if ours else 0)]
    names += [wid for wid, _, _ in worker_specs(cfg)]
    placement = device_placement(cfg, gpus_here=10**6)  # a shared GPU asked for once (ray_plan)
    if cfg.cluster.n_nodes > 1 and cfg.cluster.control != "tcp":
        raise RayLaunchError(
            f"cluster.n_nodes={cfg.cluster.n_nodes} with cluster.control={cfg.cluster.control!r}: workers on "
            "other nodes cannot reach ipc sockets; set cluster.control=tcp"
        )
    if cfg.cluster.device != "cuda":
        placement = {}  # no GPU: one bundle a process
    return RayLauncher(names, placement, address=cfg.cluster.ray_address, n_nodes=cfg.cluster.n_nodes)
