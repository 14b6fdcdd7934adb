"""What a worker process needs to find its peers: the run directory's endpoints.

The supervisor writes ``RUN_DIR/endpoints.json`` (and the resolved ``RUN_DIR/config.yaml``)
before starting anyone; every worker reads both. Endpoints are ``ipc://`` sockets in a short
private directory on one host, or ``tcp://host:port`` with ports chosen by the supervisor.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from protocols.sockets import free_tcp_port, ipc_endpoint


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


def plan_endpoints(n_reward_workers: int, host: str, control: str) -> Endpoints:
    """Fresh endpoints for one run (``control``: ``ipc`` or ``tcp``, as ``cluster.control``)."""
    extra = {
        "run_id": uuid.uuid4().hex[:10],
        "traj_store": f"{host}:{free_tcp_port(host)}",
        "weight_store": f"{host}:{free_tcp_port(host)}",
        "weights_endpoint": f"tcp://{host}:{free_tcp_port(host)}",
    }
    if control == "ipc":
        d = tempfile.mkdtemp(prefix="areal-")  # short path: ipc paths are limited to ~100 chars
        return Endpoints(
            ipc_endpoint(d, "control"),
            ipc_endpoint(d, "traj"),
            [ipc_endpoint(d, f"reward{i}") for i in range(n_reward_workers)],
            d,
            extra,
        )
    tcp = lambda: f"tcp://{host}:{free_tcp_port(host)}"  # noqa: E731
    return Endpoints(tcp(), tcp(), [tcp() for _ in range(n_reward_workers)], "", extra)
