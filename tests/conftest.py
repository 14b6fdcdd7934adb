"""Shared test set-up: CPU only, one torch thread per process (2-core machines)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


import pytest

try:
    from protocols.curve import use_curve
    from protocols.sockets import use_source_host
except ImportError:  # a bare GPU box without pyzmq: tests/gpu's modules importorskip what they need
    use_curve = use_source_host = None


@pytest.fixture(autouse=True)
def _no_curve_keys_left_behind():
    """Loading a run directory (client, status, Fleet helpers) installs its CURVE keys process-wide
    (protocols.curve); clear them after each test so a later test's tcp sockets are not keyed
    against peers that have no keys (seen: transport tests timing out after the status test)."""
    yield
    if use_curve is not None:
        use_curve(None)
        use_source_host(None)  # likewise a node address (cluster.node_hosts) set by loading a worker's run
