"""What a worker process needs to find its peers: the run directory's endpoints.

The supervisor writes ``RUN_DIR/endpoints.json`` (and the resolved ``RUN_DIR/config.yaml``)
before starting anyone; every worker reads both. Endpoints are ``ipc://`` sockets in a short
private directory on one host, or ``tcp://host:port`` with ports chosen by the supervisor, where
``host`` is the address of the node the binding process runs on (``cluster.node_hosts``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from protocols.sockets import free_tcp_port, ipc_endpoint

# the rendezvous stores of the trajectory group, the weight group and the trainer ranks, each served by the
# trainer (rank 0) over the run's sockets (transport/store.py): ipc:// in the private socket directory, or
# tcp:// on the trainer's node address with CURVE; never a torch TCPStore (no authentication, listens on *)
STORES = ("traj_store", "weight_store", "trainer_store")
NODE_HOST_ENV = "AREAL_NODE_HOST"  # the address of a worker's node (cluster.node_hosts), set by the supervisor


@dataclass
class Endpoints:
    control: str  # scheduler ROUTER
    trajectories: str  # trainer PULL (trajectory tensors)
    rewards: list[str] = field(default_factory=list)  # reward worker PULLs
    sock_dir: str = ""
    extra: dict = field(default_factory=dict)  # transport rendezvous (e.g. gloo store address)

    def save(self, run_dir: str | Path) -> None:
        tmp = Path(run_dir) / "endpoints.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, Path(run_dir) / "endpoints.json")

    @classmethod
    def load(cls, run_dir: str | Path) -> "Endpoints":
        return cls(**json.loads((Path(run_dir) / "endpoints.json").read_text()))


def plan_port(host: str) -> int:
    """A free port on ``host``: asked of the kernel when this machine has the address; for another
    machine's address (a node the supervisor does not run on) a random port below Linux's ephemeral
    range (32768-60999), so it cannot collide with a connection's port there."""
    try:
        return free_tcp_port(host)
    except OSError:
        return random.randrange(20000, 32768)


def plan_endpoints(n_reward_workers: int, host: str, control: str, hosts: Optional[dict[str, str]] = None) -> Endpoints:
    """Fresh endpoints for one run (``control``: ``ipc`` or ``tcp``, as ``cluster.control``). ``hosts``
    names the node address of each binding process (``scheduler``, ``trainer``, ``reward-<i>``), so its
    endpoints are advertised with the address it binds; a process not named binds on ``host``."""
    at = lambda who: (hosts or {}).get(who, host)  # noqa: E731
    tcp = lambda who: f"tcp://{at(who)}:{plan_port(at(who))}"  # noqa: E731
    extra = {"run_id": uuid.uuid4().hex[:10], "weights_endpoint": tcp("trainer")}
    if control == "ipc":
        d = tempfile.mkdtemp(prefix="areal-")  # short path: ipc paths are limited to ~100 chars
        extra |= {name: ipc_endpoint(d, name) for name in STORES}
        return Endpoints(
            ipc_endpoint(d, "control"),
            ipc_endpoint(d, "traj"),
            [ipc_endpoint(d, f"reward{i}") for i in range(n_reward_workers)],
            d,
            extra,
        )
    extra |= {name: tcp("trainer") for name in STORES}
    return Endpoints(tcp("scheduler"), tcp("trainer"), [tcp(f"reward-{i}") for i in range(n_reward_workers)], "", extra)
