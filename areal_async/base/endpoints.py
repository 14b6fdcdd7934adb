"""Where a run's processes listen: planned by the supervisor before anyone starts.

``plan_endpoints`` returns them as a ``RunManifest`` (``base/manifest.py``), which the supervisor
completes and writes as ``RUN_DIR/endpoints.json``; every worker reads it. Endpoints are ``ipc://``
sockets in a short private directory on one host, or ``tcp://host:port`` with ports chosen by the
supervisor, where ``host`` is the address of the node the binding process runs on (``cluster.node_hosts``).
"""

from __future__ import annotations

import random
import tempfile
import uuid
from typing import Optional

from areal_async.base.manifest import STORES, RunManifest
from protocols.sockets import free_tcp_port, ipc_endpoint

NODE_HOST_ENV = "AREAL_NODE_HOST"  # the address of a worker's node (cluster.node_hosts), set by the supervisor


def plan_port(host: str) -> int:
    """A free port on ``host``: asked of the kernel when this machine has the address; for another
    machine's address (a node the supervisor does not run on) a random port below Linux's ephemeral
    range (32768-60999), so it cannot collide with a connection's port there."""
    try:
        return free_tcp_port(host)
    except OSError:
        return random.randrange(20000, 32768)


def plan_endpoints(
    n_reward_workers: int, host: str, control: str, hosts: Optional[dict[str, str]] = None
) -> RunManifest:
    """Fresh endpoints for one run, as a manifest whose other fields keep their defaults (``control``:
    ``ipc`` or ``tcp``, as ``cluster.control``). ``hosts`` names the node address of each binding process
    (``scheduler``, ``trainer``, ``reward-<i>``), so its endpoints are advertised with the address it
    binds; a process not named binds on ``host``."""
    at = lambda who: (hosts or {}).get(who, host)  # noqa: E731
    tcp = lambda who: f"tcp://{at(who)}:{plan_port(at(who))}"  # noqa: E731
    run = {"run_id": uuid.uuid4().hex[:10], "weights_endpoint": tcp("trainer")}
    if control == "ipc":
        d = tempfile.mkdtemp(prefix="areal-")  # short path: ipc paths are limited to ~100 chars
        return RunManifest(
            control=ipc_endpoint(d, "control"),
            trajectories=ipc_endpoint(d, "traj"),
            rewards=[ipc_endpoint(d, f"reward{i}") for i in range(n_reward_workers)],
            sock_dir=d,
            **run,
            **{name: ipc_endpoint(d, name) for name in STORES},
        )
    rewards = [tcp(f"reward-{i}") for i in range(n_reward_workers)]
    return RunManifest(
        tcp("scheduler"), tcp("trainer"), rewards, "", **run, **{name: tcp("trainer") for name in STORES}
    )
