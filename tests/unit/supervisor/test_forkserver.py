"""The fork server (supervisor/forkserver.py, zygote.py) with real processes: a child it forks is checked
against the same command started by ``subprocess.Popen`` (the ordinary way, and the independent reference):
argv, /proc cmdline, environment, directory, session, stdin, signal dispositions, its log, threads joined
and atexit run at exit, exit codes and signals. Then the rules that send a start the ordinary way."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async.base.parent import PARENT_ENV, parent_env
from areal_async.config import from_dict
from areal_async.supervisor.fleet import Supervisor
from areal_async.supervisor.forkserver import (
    EXIT_UNKNOWN,
    FORKED_MODULES,
    ForkedProcess,
    ForkServer,
    ForkServerLauncher,
)
from areal_async.supervisor.launchers import LocalLauncher, LocalProcess, popen_logged
from areal_async.supervisor.watchdog import capture_hang

ROOT = Path(__file__).resolve().parents[3]
PROBE = "tests.support.fork_probe"


@pytest.fixture
def server(monkeypatch):
    monkeypatch.chdir(ROOT)
    env = dict(os.environ, AREAL_T0="1.0")
    s = ForkServer(env, ["json"])  # not the probe: `python -m` runs a module no one imported yet
    assert s.wait_ready(120) is None
    yield s
    s.close()


def _probe(tmp_path: Path, tag: str, *args: str) -> tuple[list[str], Path]:
    return [sys.executable, "-m", PROBE, str(tmp_path / f"{tag}.json"), *args], tmp_path / f"{tag}.log"


def _wait_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture(params=["sigint_handled", "sigint_ignored"])
def sigint(request):
    """The supervisor's SIGINT as it starts a worker: Python's handler, or ignored (a run started in the
    background by a non-interactive shell, as CI may start it). exec keeps an ignored signal ignored, and a
    fresh interpreter then keeps it so; else it installs its KeyboardInterrupt handler ("int")."""
    ignored = request.param == "sigint_ignored"
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    yield "ignore" if ignored else "int"
    signal.signal(signal.SIGINT, before)


def test_a_forked_child_is_what_popen_would_start(server, tmp_path, sigint):
    env = dict(server.env, AREAL_T0="2.5", AREAL_LAUNCH_TOKEN="tok")  # what differs per worker
    runs = {}
    for tag in ("popen", "forked"):
        cmd, log = _probe(tmp_path, tag, "3")
        if tag == "popen":
            proc = LocalProcess(popen_logged(cmd, env | parent_env(), log))  # as LocalLauncher.start does
        else:
            proc = ForkedProcess(server, server.fork(tag, cmd, env, log))
        runs[tag] = (proc.wait(60), json.loads((tmp_path / f"{tag}.json").read_text()), log.read_text())
    (code_p, rep_p, log_p), (code_f, rep_f, log_f) = runs["popen"], runs["forked"]
    assert code_p == code_f == 3
    assert log_p == log_f == "probe stdout\nprobe stderr\n"
    # each is named the child of its own parent (base/parent.py): this process, and the fork server
    assert rep_p["env"].pop(PARENT_ENV) == str(os.getpid()) and rep_f["env"].pop(PARENT_ENV) == str(server.proc.pid)
    for key in ("env", "cwd", "session_leader", "group_leader", "stdin", "signals", "name", "gc_enabled"):
        assert rep_f[key] == rep_p[key], key
    assert rep_p["session_leader"] and rep_p["stdin"] == "/dev/null" and rep_p["name"] == "__main__"
    assert rep_p["gc_enabled"] is True  # the server runs with it off (zygote.py): each child turns it back on
    assert rep_f["signals"]["SIGINT"] == rep_p["signals"]["SIGINT"] == sigint
    # argv and cmdline name each one's own output file: the same but for the tag (the file's name alone: a
    # pytest-xdist worker's tmp_path holds "popen-gw0")
    assert rep_f["argv"] == [a.replace("popen.json", "forked.json") for a in rep_p["argv"]]
    assert rep_f["cmdline"] == [a.replace("popen.json", "forked.json") for a in rep_p["cmdline"]]
    assert rep_p["cmdline"][:3] == [sys.executable, "-m", PROBE]
    for tag in ("popen", "forked"):  # the non-daemon thread was joined, then atexit ran
        assert (tmp_path / f"{tag}.json.thread").read_text() == "joined"
        assert (tmp_path / f"{tag}.json.atexit").read_text() == "ran"


def test_signals_and_exit_codes_match_popen(server, tmp_path):
    cmd, log = _probe(tmp_path, "forked", "--sleep", "60")
    child = ForkedProcess(server, server.fork("a", cmd, server.env, log))
    ref = LocalProcess(popen_logged(_probe(tmp_path, "popen", "--sleep", "60")[0], server.env, tmp_path / "p.log"))
    assert child.poll() is None and ref.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.signal(signal.SIGTERM)
    ref.signal(signal.SIGTERM)
    assert child.wait(30) == ref.wait(30) == -signal.SIGTERM
    assert child.returncode == -signal.SIGTERM
    child.signal(signal.SIGTERM)  # ended: nothing is sent, nothing raised


@pytest.mark.parametrize("end", ["none", "text", "big", "negative", "raise"])
def test_a_child_ends_with_the_status_and_words_popen_gives(server, tmp_path, end):
    """The forked child ends without the interpreter's teardown (zygote.end_child): its status and what it
    printed are still those of the same command started the ordinary way."""
    cmd = [sys.executable, "-m", "tests.support.exit_probe", end]
    ref = LocalProcess(popen_logged(cmd, server.env, tmp_path / "popen.log"))
    child = ForkedProcess(server, server.fork("a", cmd, server.env, tmp_path / "forked.log"))
    assert child.wait(60) == ref.wait(60) == {"none": 0, "text": 1, "big": 300 & 0xFF, "negative": 254, "raise": 1}[end]
    said = [(tmp_path / f"{tag}.log").read_text().strip().splitlines() for tag in ("popen", "forked")]
    if end == "raise":  # the traceback's frames differ (runpy's from `python -m`, the server's): its last line
        assert said[0][-1] == said[1][-1] == "RuntimeError: boom"
    else:
        assert said[0] == said[1] == (["stopped: a message"] if end == "text" else [])


def test_a_child_outlives_its_server_and_reports_exit_unknown_once_it_ends(server, tmp_path):
    cmd, log = _probe(tmp_path, "forked", "--sleep", "60")
    child = ForkedProcess(server, server.fork("a", cmd, server.env, log))
    server.proc.kill()
    server.proc.wait()
    time.sleep(0.2)
    assert child.poll() is None  # still running, now a child of init
    _killpg(child.pid)
    assert child.wait(30) == EXIT_UNKNOWN


def test_close_ends_the_server_and_not_its_children(server, tmp_path):
    cmd, log = _probe(tmp_path, "forked", "--sleep", "60")
    pid = server.fork("a", cmd, server.env, log)
    server.close()
    assert server.proc.returncode == 0
    os.kill(pid, 0)  # alive (raises if not)
    _killpg(pid)


def _killpg(pid: int) -> None:
    """SIGKILL the child's session once it leads it: the fork server returns the pid before the child's setsid
    (CI once met killpg's "No such process" between the two)."""
    deadline = time.monotonic() + 10
    while os.getpgid(pid) != pid:
        assert time.monotonic() < deadline, f"pid {pid} never led its own process group"
        time.sleep(0.01)
    os.killpg(pid, signal.SIGKILL)


def test_the_hang_capture_reaches_a_forked_worker(server, tmp_path):
    """The step watchdog's capture (supervisor/watchdog.capture_hang) dumps a forked child's stacks as a
    Popen child's: both are processes of this machine (``Launched.on_this_machine``)."""
    cmd = [sys.executable, "-m", "tests.support.stack_probe", str(tmp_path), "trainer"]
    child = ForkedProcess(server, server.fork("trainer", cmd, server.env, tmp_path / "trainer.log"))
    try:
        _wait_file(tmp_path / "ready")
        capture_hang(tmp_path, {"trainer": child}, "a test")
        (cap,) = [json.loads(x) for x in (tmp_path / "hangs.jsonl").read_text().splitlines()]
        assert cap["workers"]["trainer"]["dumped"] and cap["workers"]["trainer"]["pid"] == child.pid
        assert "in wait_here" in (tmp_path / "stacks" / "trainer.txt").read_text()
    finally:
        child.signal(signal.SIGKILL)
        child.wait(30)


def test_what_is_forked_and_what_starts_the_ordinary_way(server):
    cmd = [sys.executable, "-m", "workers.rollout", "--run-dir", "/r", "--worker-id", "rollout-0", "--index", "0"]
    assert server.forkable(cmd, dict(server.env, AREAL_LAUNCH_TOKEN="t", AREAL_NODE_HOST="h")) is None
    assert server.forkable(cmd, dict(server.env, OMP_NUM_THREADS="7")) == (
        "its environment differs from the fork server's in ['OMP_NUM_THREADS']"
    )
    assert "PYTHONPATH" in server.forkable(cmd, {k: v for k, v in server.env.items()} | {"PYTHONPATH": "/x"})
    assert server.forkable([sys.executable, "-m", "workers.reward"], server.env) == ""  # not served: silent
    assert server.forkable([*cmd[:2], "workers.scheduler", *cmd[3:]], server.env) is None
    assert server.forkable(["/other/python", "-m", "workers.rollout"], server.env) == ""
    long = cmd + ["--cpus", "0," * 2000 + "1"]
    assert server.forkable(long, server.env) == "its command line is longer than the fork server's room for it"


def test_a_server_that_cannot_import_sends_its_starts_the_ordinary_way(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    broken = ForkServer(dict(os.environ), ["no_such_module_for_the_fork_server"])
    try:
        why = broken.wait_ready(120)
        assert why == "its imports failed (ModuleNotFoundError: No module named 'no_such_module_for_the_fork_server')"
        launcher = ForkServerLauncher(broken)
        log = tmp_path / "trainer.log"
        proc = launcher.start("trainer", [sys.executable, "-m", "workers.trainer", "--help"], broken.env, log)
        assert isinstance(proc, LocalProcess) and proc.wait(60) == 0
        assert log.read_text().startswith("usage: workers.trainer")
        told = f"areal-async: warning: fork server: {why}; trainer starts with a fresh interpreter\n"
        assert capsys.readouterr().err == told
    finally:
        broken.close()


def test_a_signal_to_the_run_ends_a_start_waiting_for_the_server_s_imports(monkeypatch, tmp_path, capsys):
    """SIGTERM while the server still imports (a loaded machine: minutes): the supervisor's handler calls
    ``interrupt`` and the waiting start goes the ordinary way at once, as every start did without a server."""
    monkeypatch.chdir(ROOT)
    slow = ForkServer(dict(os.environ), ["tests.support.slow_import"])  # its import sleeps 60 s
    launcher = ForkServerLauncher(slow)
    try:
        old = signal.signal(signal.SIGALRM, lambda *_: launcher.interrupt())  # as Supervisor.on_signal does
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        t0 = time.monotonic()
        log = tmp_path / "trainer.log"
        proc = launcher.start("trainer", [sys.executable, "-m", "workers.trainer", "--help"], slow.env, log)
        waited = time.monotonic() - t0
        assert isinstance(proc, LocalProcess) and proc.wait(60) == 0
        assert 0.5 <= waited < 10, waited  # the 0.5 s until the signal, not the import's 60 s
        told = "areal-async: warning: fork server: the run is stopping; trainer starts with a fresh interpreter\n"
        assert capsys.readouterr().err == told
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t0 = time.monotonic()
        launcher.close()
        closed_in = time.monotonic() - t0
    assert slow.proc.returncode == -signal.SIGKILL  # still importing at close: killed, its stdin's EOF unread
    assert closed_in < 4, closed_in  # at once, not after the 5 s an EOF is given (a refused run waited them)


def _module_level_environ_reads(path: Path) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``environ`` uses outside any function of ``path``."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            name = child.attr if isinstance(child, ast.Attribute) else child.id if isinstance(child, ast.Name) else ""
            if name in ("environ", "getenv") and not inside:
                found.append(f"{path.relative_to(ROOT)}:{child.lineno}")
            visit(child, inside)

    visit(tree, False)
    return found


def test_no_module_reads_the_environment_at_import():
    """What lets a request's AREAL_* variables differ from the server's (FORKABLE_ENV_DIFF): the project
    reads the environment only inside functions, so a module the server imported read none of it."""
    found = [hit for pkg in ("areal_async", "protocols", "workers") for p in sorted((ROOT / pkg).rglob("*.py"))
             for hit in _module_level_environ_reads(p)]  # fmt: skip
    assert found == []


class _Recording(LocalLauncher):
    """Starts each command as a sleeping stand-in and records the order; the fork server's rule for what waits."""

    def __init__(self):
        self.started: list[str] = []

    def waits(self, cmd: list[str], env: dict) -> bool:
        return len(cmd) > 2 and cmd[2] in FORKED_MODULES

    def start(self, name, cmd, env, log_path, node=0):
        self.started.append(name)
        return super().start(name, [sys.executable, "-c", "import time; time.sleep(30)"], env, log_path, node)


def test_the_supervisor_starts_what_waits_for_the_server_last(tmp_path, server):
    """The reward worker (a fresh interpreter) starts before the scheduler, trainer and rollouts, whose starts
    wait for the server's imports; each group keeps the start order of worker_specs."""
    cmd = [sys.executable, "-m", "workers.scheduler", "--run-dir", "/r", "--worker-id", "scheduler", "--index", "0"]
    assert ForkServerLauncher(server).waits(cmd, dict(server.env, AREAL_LAUNCH_TOKEN="t"))
    assert not ForkServerLauncher(server).waits([*cmd[:2], "workers.reward", *cmd[3:]], server.env)
    launcher = _Recording()
    cfg = from_dict(
        {},
        [
            "cluster.n_rollout_workers=2",
            "cluster.n_reward_workers=2",
            "cluster.heartbeat_s=0.5",
            "cluster.step_timeout_s=1",
        ],
    )
    sup = Supervisor(cfg, tmp_path / "run")
    sup.launcher = launcher
    sup.prepare()
    time.sleep(1.5)  # as a start waiting for the server's imports: longer than step_timeout_s
    try:
        sup.start_all()
        # the scheduler has written no status yet: the starting clock runs from the end of start_all
        assert sup.watchdog.check() is None
    finally:
        sup.stop_all()
    assert launcher.started == ["reward-0", "reward-1", "scheduler", "trainer", "rollout-0", "rollout-1"]
    pids = json.loads((tmp_path / "run" / "pids.json").read_text())
    assert set(pids) - {"supervisor", "placement"} == set(launcher.started)


def test_the_workers_environment_limits_malloc_arenas_unless_the_user_set_it(monkeypatch):
    """cluster.malloc_arenas reaches every worker (and the fork server, whose arenas its children inherit)
    as MALLOC_ARENA_MAX, read by glibc at its first malloc; a value in the user's environment wins; 0 leaves
    glibc's default (no variable)."""
    from areal_async.supervisor.forkserver import worker_env

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert worker_env(from_dict({}))["MALLOC_ARENA_MAX"] == "1"
    assert worker_env(from_dict({"cluster": {"malloc_arenas": 3}}))["MALLOC_ARENA_MAX"] == "3"
    assert "MALLOC_ARENA_MAX" not in worker_env(from_dict({"cluster": {"malloc_arenas": 0}}))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert worker_env(from_dict({}))["MALLOC_ARENA_MAX"] == "4"


class _OneChild:
    """The part of a fork server that ``ForkedProcess`` asks: a real child's exit status (None while it runs)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def returncode(self, pid: int):
        assert pid == self.proc.pid
        return self.proc.poll()


def test_a_signal_before_the_child_leads_its_group_still_reaches_it():
    """Just forked, the child has not yet called setsid: no process group has its pid, so ``killpg`` finds
    nothing (ci33 met this window). The signal goes to the child itself, which has started nothing yet. Here a
    real child that never leads a group (started in this process's own group) stands for that moment."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)  # the window: no group of that id
        ForkedProcess(_OneChild(child), child.pid).signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
