"""Shared test set-up: CPU only, one torch thread per process (2-core machines)."""

import gc
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


def pytest_collection_finish(session):
    """Move what collection loaded (torch, transformers, every test module: about 0.5 M objects) out of the
    collector's sight (``gc.freeze``). A full collection then walks only what the tests made since: the shm tests'
    ``gc.collect()`` calls (which drop a received message's slab) took 0.1-0.5 s each with that heap in view, and
    the interpreter's own full collections as long. What the tests make is collected as before."""
    gc.collect()
    gc.freeze()


# ---- CI: tests that must run, never skip ------------------------------------------------------------
MUST_RUN_ENV = "AREAL_MUST_RUN"  # comma-separated test files (.ci/run sets it): a skip there is a failure


def must_run(nodeid: str, env: str | None = None) -> bool:
    files = [f.strip() for f in (os.environ.get(MUST_RUN_ENV, "") if env is None else env).split(",") if f.strip()]
    return any(nodeid == f or nodeid.startswith(f + "::") for f in files)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a test of a must-run file that skips (a missing tool, no network, an importorskip) fails,
    with the skip's reason: a green CI then means it ran."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and must_run(item.nodeid):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped, but {MUST_RUN_ENV} says it must run here: {reason}"
