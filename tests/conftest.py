"""Shared test set-up: CPU only, one torch thread per process (2-core machines)."""

import gc
import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


import pytest

from tests.support.procs import descendants

try:
    from protocols.curve import use_curve
    from protocols.sockets import use_source_host
except ImportError:  # a bare GPU box without pyzmq: tests/gpu's modules importorskip what they need
    use_curve = use_source_host = None


try:  # pyzmq's collector hazard (tests/support/zmq_gc.py): a context freed with its sockets hangs the worker
    from tests.support.zmq_gc import collected_contexts_are_not_terminated

    collected_contexts_are_not_terminated()
except ImportError:  # a bare GPU box without pyzmq
    pass


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


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker with ``--no-loadscope-reorder`` (``.ci/run``), the slowest test files first
    (``tests/support/file_order.py``): the workers take whole files in this order and finish together. Without
    xdist, or with its own reorder (files by test count), the order is pytest's."""
    if hasattr(config, "workerinput") and config.getoption("loadscopereorder", True) is False:
        from tests.support.file_order import file_seconds, slowest_first

        items[:] = slowest_first(items, file_seconds())


# ---- CI: tests that must run, never skip; the skips each tier may have ----------------------------
MUST_RUN_ENV = "AREAL_MUST_RUN"  # comma-separated test files (.ci/run sets it): a skip there is a failure
SKIPS_ENV = "AREAL_EXPECT_SKIPS"  # the tier .ci/run is running (e.g. tests/unit): its skips must be EXPECTED_SKIPS'
# The skips each CI tier has on the CI machine (.ci/run: every extra, the vLLM and TRL environments, Slurm), the one
# place they are pinned: a run whose count differs fails, listing every skip with its reason. Change a count here,
# in the commit that adds or removes the skip, saying why.
EXPECTED_SKIPS = {"tests/unit": 0, "tests/bench": 0, "tests/contract": 0, "tests/e2e": 0}


def must_run(nodeid: str, env: str | None = None) -> bool:
    files = [f.strip() for f in (os.environ.get(MUST_RUN_ENV, "") if env is None else env).split(",") if f.strip()]
    return any(nodeid == f or nodeid.startswith(f + "::") for f in files)


def _reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a test of a must-run file that skips (a missing tool, no network, an importorskip) fails,
    with the skip's reason: a green CI then means it ran."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and must_run(item.nodeid):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped, but {MUST_RUN_ENV} says it must run here: {_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test body that fails (pytest-timeout's "Timeout" among others) before it stops what it started leaves it
    running: a fleet's supervisor and workers would then take the CPUs of the tests after it, and of its own
    rerun (.ci/run reruns a timeout). So the processes under this one that the body started (not there before it:
    a fixture's server, started at setup, stays) and that are still alive when it failed are SIGKILLed, by pid."""
    before = descendants(os.getpid())
    outcome = yield
    if outcome.excinfo is not None:
        for pid in descendants(os.getpid()) - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Likewise a must-run file that skips as a whole while it is collected (a module-level
    ``importorskip`` or ``pytest.skip(allow_module_level=True)``): a collection error naming the reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and must_run(report.nodeid):
        report.outcome = "failed"
        report.longrepr = (
            f"{report.nodeid} skipped as a whole, but {MUST_RUN_ENV} says it must run here: {_reason(report)}"
        )


class SkipCount:
    """This session's skips (tests and whole files, "nodeid: reason"), and the check of their number against
    ``EXPECTED_SKIPS`` when ``AREAL_EXPECT_SKIPS`` names the tier. One per pytest config (``pytest_configure``):
    a pytest run inside a test (pytester) counts its own."""

    def __init__(self):
        self.skips: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(f"{report.nodeid}: {_reason(report)}")

    def pytest_collectreport(self, report):
        if report.skipped:
            self.skips.append(f"{report.nodeid} (whole file): {_reason(report)}")

    def pytest_sessionfinish(self, session, exitstatus):
        """Under CI, the session fails unless each tier it runs has exactly ``EXPECTED_SKIPS[tier]`` skips (one
        tier: every skip of the session; several, space-separated, as ``.ci/run`` runs the tiers after the unit
        tests in one session: the skips under each tier's folder); the failure lists the skips with their
        reasons."""
        tiers = os.environ.get(SKIPS_ENV, "").split()
        tw = session.config.pluginmanager.get_plugin("terminalreporter")
        args = [a.rstrip("/") for a in session.config.args]
        if not tiers or any(t not in args for t in tiers):
            return  # not the tiers' own run (a pytest started inside a test inherits the environment)
        if hasattr(session.config, "workerinput"):
            return  # a pytest-xdist worker sees only its share: its controller counts (every report reaches it)
        for tier in tiers:
            skips = self.skips if len(tiers) == 1 else [s for s in self.skips if s.startswith(tier + "/")]
            expected = EXPECTED_SKIPS.get(tier)
            if len(skips) == expected:
                if tw is not None:
                    tw.write_line(
                        f"\n{SKIPS_ENV}: {tier}: {expected} skip(s), as EXPECTED_SKIPS (tests/conftest.py) pins"
                    )
                continue
            if expected is None:
                why = f"{tier} is not a tier of EXPECTED_SKIPS {sorted(EXPECTED_SKIPS)}"
            else:
                why = f"{tier}: {len(skips)} skip(s), EXPECTED_SKIPS (tests/conftest.py) pins {expected}"
            if tw is not None:
                tw.write_line("\n".join(["", f"{SKIPS_ENV}: {why}", *(f"  skipped: {s}" for s in skips)]), red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.pluginmanager.register(SkipCount(), "areal_skip_count")
