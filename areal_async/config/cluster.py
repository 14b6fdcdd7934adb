"""The fleet's config sections: its shape and control plane (``cluster``), CPU pinning
(``cluster.cpu_affinity``), Slurm (``cluster.slurm``) and the tensor channels (``tensor_channel``).

Each dataclass checks its own fields when built (``check()``, run by ``Section.__post_init__``);
rules that join sections live on ``ExperimentConfig`` (``experiment.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_async.base.affinity import parse_cpu_list
from areal_async.config.base import CpuList, Section, _f, above, at_least, one_of, require
from protocols.channels import CHANNEL_KINDS


@dataclass
class CpuAffinityConfig(Section):
    """CPUs each role's processes are pinned to (Linux cpu-list syntax: '0', '1-3', '0,2'); '' = not pinned.

    Opt-in. On a machine with few cores it gives the trainer a core of its own, as it has its own
    devices on a GPU cluster: in an async pipeline the trainer is the bottleneck whenever
    t_train >= t_gen, and every time slice it loses to decoding or reward checks is lost
    throughput. Checked against the CPUs this machine allows before anything starts."""

    scheduler: CpuList = _f("", "CPUs of the scheduler process.")
    trainer: CpuList = _f("", "CPUs of the trainer process.")
    rollout: CpuList = _f("", "CPUs of every rollout worker.")
    reward: CpuList = _f("", "CPUs of every reward worker and its checking processes.")

    def check(self) -> None:
        for role in ("scheduler", "trainer", "rollout", "reward"):
            spec = getattr(self, role)
            require(
                spec == "" or _is_cpu_list(spec),
                role,
                spec,
                "a cpu list such as '0', '1-3' or '0,2' (or '' for no pinning)",
            )


def _is_cpu_list(spec: str) -> bool:
    try:
        parse_cpu_list(spec)
    except ValueError:
        return False
    return True


@dataclass
class SlurmConfig(Section):
    """How ``cluster.launcher=slurm`` asks Slurm for the run (supervisor/slurm.py)."""

    partition: str = _f("", "sbatch --partition ('' = the cluster's default).")
    account: str = _f("", "sbatch --account ('' = none).")
    time_limit: str = _f("", "sbatch --time, e.g. '2-00:00:00' ('' = the partition's limit).")
    cpus_per_node: int = _f(
        0, "sbatch --cpus-per-task for the one task per node the supervisor's steps share (0 = Slurm's default)."
    )
    sbatch_args: list = _f([], "More '#SBATCH' options, each one string such as '--qos=high'.")
    srun_args: list = _f([], "More options for every worker's srun step, e.g. '--mpi=none'.")
    submit: bool = _f(
        True,
        "Outside an allocation: submit the rendered script with sbatch (false: only write "
        "RUN_DIR/sbatch.sh and print how to submit it).",
    )

    def check(self) -> None:
        at_least(self, "cpus_per_node", 0)
        for name in ("sbatch_args", "srun_args"):
            bad = [a for a in getattr(self, name) if not isinstance(a, str) or not a.startswith("-") or "\n" in a]
            require(not bad, name, getattr(self, name), "a list of option strings, each starting with '-'")


@dataclass
class ClusterConfig(Section):
    """Fleet shape and the control plane."""

    n_rollout_workers: int = _f(2, "Rollout worker processes.")
    n_reward_workers: int = _f(
        1,
        "Reward worker processes (0 with n_external_reward_workers >= 1: all scoring is "
        "done by bring-your-own workers).",
    )
    n_external_reward_workers: int = _f(
        0,
        "Reward endpoints kept for bring-your-own reward workers "
        "(areal_async.client.RewardWorker, slot 0..N-1): the supervisor starts none "
        "for them; rollout workers send them their share of reward requests, "
        "which wait until a worker serves the slot.",
    )
    launcher: str = _f(
        "local",
        "local (child processes) | slurm (srun steps in one allocation; submits an sbatch "
        "script when run outside one) | ray.",
    )
    slurm: SlurmConfig = _f(SlurmConfig(), "Slurm options of cluster.launcher=slurm.")
    ray_address: str = _f(
        "",
        "cluster.launcher=ray: the Ray cluster to join ('auto', 'ray://head:10001'); '' starts "
        "a local Ray for the run.",
    )
    control: str = _f("ipc", "ZeroMQ endpoints: 'ipc' (one host) or 'tcp'.")
    host: str = _f("127.0.0.1", "Address the scheduler and trainer bind for 'tcp'.")
    node_hosts: list = _f(
        [],
        "Address of each node (cluster.n_nodes entries) for 'tcp': a process placed on node k binds its "
        "endpoints on node_hosts[k], advertises them with it and connects from it. Empty: every node is "
        "cluster.host. On one machine, ['127.0.0.1', '127.0.0.2'] makes two loopback nodes.",
    )
    curve: bool = _f(
        True,
        "CURVE authentication and encryption on every tcp:// socket, servers admitting only the "
        "run's client keys (RUN_DIR/keys, 0600). false: plain TCP, for measuring its cost or on a "
        "network that is already private; registration still needs the launch token.",
    )
    heartbeat_s: float = _f(2.0, "Heartbeat period of every worker.")
    worker_timeout_s: float = _f(120.0, "A worker silent this long is declared dead.")
    max_restarts: int = _f(
        2,
        "Times the supervisor restarts each dead rollout or reward worker before failing the run "
        "(zmq/shm channels only); the trainer and scheduler are never restarted: rerun with "
        "recover.mode=auto (or set recover.retries).",
    )
    step_timeout_s: float = _f(
        600.0,
        "Supervisor watchdog: no trainer step for this many seconds (after the trainer "
        "is ready) fails the run (or recovers it, recover.retries), naming the silent "
        "role and what it waited for; 0 = no watchdog.",
    )
    torch_threads: int = _f(1, "torch intra-op threads per worker process.")
    share_cores: bool = _f(
        False,
        "Threads that follow the work: the trainer ranks and embedded rollout engines on this machine split its "
        "CPUs among those busy at the moment, re-divided before each decoder layer (forward and backward) and "
        "engine step, so a role that waits holds no core the busy one could use; OpenMP idle threads sleep "
        "(OMP_WAIT_POLICY=PASSIVE). Replaces torch_threads for them (base/cores.py). One node only.",
    )
    fork_server: bool = _f(
        True,
        "Local CPU runs: the scheduler, trainer and rollout processes are forked from one process that "
        "imported their modules (torch, transformers) once, while the preflight runs (supervisor/forkserver.py); "
        "false: each imports its own. Ignored on cuda and under Slurm or Ray.",
    )
    retained_heap_mb: int = _f(
        256,
        "MiB of freed memory each torch worker keeps in its heap instead of returning it to the OS "
        "(glibc mallopt; base/process.retain_freed_heap): a step's activation-sized blocks are then "
        "reused without page faults; 0 = glibc's defaults.",
    )
    malloc_arenas: int = _f(
        1,
        "glibc malloc arenas per worker process (MALLOC_ARENA_MAX in the workers' and the fork server's "
        "environment, and mallopt M_ARENA_MAX at a torch worker's start: base/process.limit_malloc_arenas): "
        "with glibc's default (8 per core) each executor thread that ran a training step kept that step's "
        "freed activations in an arena of its own; 0 = glibc's default.",
    )
    cpu_affinity: CpuAffinityConfig = _f(CpuAffinityConfig(), "Pin each role's processes to CPUs (local launcher).")
    device: str = _f("cpu", "cpu | cuda.")
    n_nodes: int = _f(1, "Machines in the fleet (the seed: one node); placement hands out their GPUs node by node.")
    n_gpus_per_node: int = _f(
        8,
        "GPUs per machine (the seed: 8); bounds the rollout backend's data-parallel degree "
        "dN and the placement (supervisor/placement.py).",
    )
    gpu_memory_gib: Optional[float] = _f(
        None,
        "Memory of one GPU in GiB (cluster.device=cuda), for the preflight's memory budget per GPU "
        "(supervisor/weight_path.py); None = nvidia-smi's on this machine, else 80 assumed and nothing refused on it.",
    )
    n_trainer_ranks: int = _f(
        1,
        "Data-parallel trainer processes: FSDP2 over gloo (cpu) / NCCL (cuda, one GPU each), "
        "the batch split by tokens, one global loss normalisation; rank 0 talks to the "
        "scheduler and publishes the weights.",
    )

    def check(self) -> None:
        at_least(self, "n_rollout_workers", 1)
        at_least(self, "n_reward_workers", 0)
        at_least(self, "n_external_reward_workers", 0)
        require(
            self.n_reward_workers + self.n_external_reward_workers >= 1,
            "n_reward_workers",
            self.n_reward_workers,
            ">= 1, or n_external_reward_workers >= 1 (someone must score)",
        )
        one_of(self, "launcher", ("local", "ray", "slurm"))
        one_of(self, "control", ("ipc", "tcp"))
        above(self, "heartbeat_s", 0)
        require(
            self.worker_timeout_s > self.heartbeat_s,
            "worker_timeout_s",
            self.worker_timeout_s,
            f"> heartbeat_s={self.heartbeat_s}",
        )
        at_least(self, "max_restarts", 0)
        require(
            self.step_timeout_s == 0 or self.step_timeout_s > self.heartbeat_s,
            "step_timeout_s",
            self.step_timeout_s,
            f"0 (no watchdog) or > heartbeat_s={self.heartbeat_s}",
        )
        at_least(self, "torch_threads", 1)
        require(
            not self.share_cores or self.n_nodes == 1,
            "share_cores",
            self.share_cores,
            f"false with n_nodes={self.n_nodes} (the CPU table is one machine's)",
        )
        at_least(self, "retained_heap_mb", 0)
        at_least(self, "malloc_arenas", 0)
        one_of(self, "device", ("cpu", "cuda"))
        at_least(self, "n_nodes", 1)
        at_least(self, "n_gpus_per_node", 1)
        require(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "gpu_memory_gib", self.gpu_memory_gib, "> 0")
        at_least(self, "n_trainer_ranks", 1)
        self._check_node_hosts()

    def _check_node_hosts(self) -> None:
        hosts = self.node_hosts
        if not hosts:
            return
        bad = [h for h in hosts if not isinstance(h, str) or not h or any(c in h for c in " :/;*")]
        require(not bad, "node_hosts", hosts, "a list of host names or IPv4 addresses (no port, no '*')")
        require(
            len(hosts) == self.n_nodes, "node_hosts", hosts, f"one address per node (cluster.n_nodes={self.n_nodes})"
        )
        require(
            self.control == "tcp" or len(set(hosts)) == 1,
            "node_hosts",
            hosts,
            f"one address, or cluster.control=tcp (control={self.control!r}: ipc sockets reach one host only)",
        )

    def hosts(self) -> list[str]:
        """The address of every node: ``node_hosts``, else ``host`` for each of ``n_nodes``."""
        return list(self.node_hosts) or [self.host] * self.n_nodes


@dataclass
class TensorChannelConfig(Section):
    """How tensors move (trajectories rollout -> trainer, weights trainer -> rollout)."""

    weights: str = _f("shm", f"Weight channel: {' | '.join(CHANNEL_KINDS)}.")
    trajectories: str = _f("zmq", f"Trajectory channel: {' | '.join(CHANNEL_KINDS)}.")
    bucket_mb: float = _f(64.0, "Weight-sync bucket size in MiB.")
    weight_delta: bool = _f(
        False,
        "Publish each weight version also as its delta against the previous one (the 16-bit lanes that changed, "
        "zlib-compressed; transport/delta.py): a rollout worker holding the previous version fetches only that "
        "and checks the result against the full version's checksums; one that does not (restarted, missed or "
        "refused a version) fetches the full weights. Pull channels only (weights: shm or zmq).",
    )
    max_message_mb: float = _f(
        1024.0,
        "Bound on one trajectory message (a group's tensors) at the trainer, MiB: a zmq frame larger is "
        "dropped at the socket (ZMQ_MAXMSGSIZE) before it is allocated; a header or gloo/nccl note "
        "declaring more is refused before anything is allocated.",
    )

    def check(self) -> None:
        one_of(self, "weights", CHANNEL_KINDS)
        one_of(self, "trajectories", CHANNEL_KINDS)
        require(
            not self.weight_delta or self.weights in ("shm", "zmq"),
            "weight_delta",
            self.weight_delta,
            f"false with weights={self.weights!r}: delta needs weights shm or zmq (a broadcast gives every rollout "
            "worker one payload, so one without the previous version could not get the full weights)",
        )
        above(self, "bucket_mb", 0)
        above(self, "max_message_mb", 0)
