"""benchmarks/common/cpu.py against real processes whose CPU use is known from their own clocks."""

import subprocess
import sys
import time

import pytest

from benchmarks.common import cpu

# Burns `target` CPU seconds by its own process clock (clock_gettime, independent of /proc), prints
# what it burned, then idles until its stdin closes: /proc must then report the same amount.
BURNER = """
import sys, time
target = float(sys.argv[1])
t0 = time.process_time()
while time.process_time() - t0 < target:
    pass
print(time.process_time(), flush=True)
sys.stdin.read()
"""

# Starts a burner and an idler under itself, each named by --worker-id, says "ready" once both run.
PARENT = f"""
import subprocess, sys
burner = subprocess.Popen([sys.executable, "-c", {BURNER!r}, "0.4", "--worker-id", "burner"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
idler = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--worker-id", "idler"],
                         stdin=subprocess.PIPE)
print(burner.stdout.readline().strip(), flush=True)
sys.stdin.read()
burner.stdin.close(); idler.stdin.close(); burner.wait(); idler.wait()
"""

# Runs two burners of one role one after the other (as a reward pool replaces a child): prints each one's
# total once it has burned, and keeps it idle until told (a line on stdin) that a sampler has read that
# total, then ends it and starts the next; after the second, idles until its stdin closes.
SUCCESSION = f"""
import subprocess, sys
for _ in range(2):
    p = subprocess.Popen([sys.executable, "-c", {BURNER!r}, "0.3", "--worker-id", "pool"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(p.stdout.readline().strip(), flush=True)
    sys.stdin.readline()
    p.stdin.close(); p.wait()
    print("ended", flush=True)
sys.stdin.read()
"""

# Idles as "-c ..." until told, then execs itself into a process named by --worker-id (what a worker
# does right after the supervisor forks it, when a sampler may already have seen it).
EXECS_LATER = """
import os, sys
print("ready", flush=True)
sys.stdin.readline()
os.execv(sys.executable, [sys.executable, "-c", "import sys; sys.stdin.read()", "--worker-id", "late"])
"""

TICK = 1 / cpu.CLK_TCK


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


def _wait_samples(sampler: cpu.TreeCPU, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(sampler.samples) < n:
        assert time.monotonic() < deadline, f"{len(sampler.samples)} of {n} samples in {timeout_s} s"
        time.sleep(0.02)


def test_proc_cpu_s_reads_what_a_busy_child_burned_and_nothing_while_it_idles():
    proc = _start(BURNER, "0.5")
    try:
        burned = float(proc.stdout.readline())  # whole-process CPU by its own clock (start-up included)
        got = cpu.proc_cpu_s(proc.pid)
        assert got == pytest.approx(burned, abs=3 * TICK + 0.02)
        assert burned >= 0.5
        time.sleep(0.5)  # blocked on stdin: no CPU
        assert cpu.proc_cpu_s(proc.pid) - got <= 2 * TICK
    finally:
        _finish(proc)
    assert cpu.proc_cpu_s(proc.pid) is None  # reaped: gone


def test_tree_sampler_sums_a_process_tree_by_role():
    root = _start(PARENT)
    try:
        burned = float(root.stdout.readline())  # the burner grandchild is done burning
        sampler = cpu.TreeCPU(root.pid, progress=lambda: 7, period_s=0.05)
        sampler.start()
        _wait_samples(sampler, 2)  # not a fixed sleep: a loaded runner may not run the sampler for a while
        sampler.stop()
        steps, per_role = sampler.samples[-1]
        assert steps == 7 and set(per_role) == {"burner", "idler", "other"}  # the root's argv is "-c ...": other
        assert per_role["burner"] == pytest.approx(burned, abs=3 * TICK + 0.02)
        assert per_role["idler"] < 0.5 * burned  # an interpreter's start-up only
        assert len(cpu.tree_cpu(root.pid)) == 3
    finally:
        _finish(root)


def _sampled(sampler: cpu.TreeCPU, role: str, at_least: float, timeout_s: float = 30.0) -> None:
    """Wait until one of ``sampler``'s samples holds ``at_least`` CPU s for ``role`` (not a fixed sleep: a
    loaded runner may not run the sampler's thread for a while)."""
    deadline = time.monotonic() + timeout_s
    while not any(per_role.get(role, 0.0) >= at_least for _, per_role in list(sampler.samples)):
        assert time.monotonic() < deadline, f"no sample saw {at_least:.3f} CPU s of {role!r}: {sampler.samples[-3:]}"
        time.sleep(0.02)


def test_a_role_keeps_the_cpu_of_its_exited_processes():
    root = _start(SUCCESSION)
    sampler = cpu.TreeCPU(root.pid, progress=lambda: 0, period_s=0.05)
    sampler.start()
    try:
        first = float(root.stdout.readline())
        _sampled(sampler, "pool", first - 3 * TICK - 0.02)  # the first burner's total read while it still ran
        root.stdin.write("next\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "ended"  # the first burner has exited
        second = float(root.stdout.readline())
        _sampled(sampler, "pool", first + second - 6 * TICK - 0.04)
        root.stdin.write("next\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "ended"
        n = len(sampler.samples)
        _wait_samples(sampler, n + 2)  # samples taken after both burners exited
    finally:
        sampler.stop()
        _finish(root)
    pool = [per_role.get("pool", 0.0) for _, per_role in sampler.samples]
    assert all(b >= a for a, b in zip(pool, pool[1:]))  # never drops when the first burner is replaced
    assert pool[-1] == pytest.approx(first + second, abs=6 * TICK + 0.04)


def test_a_process_is_named_by_its_current_command_line():
    proc = _start(EXECS_LATER)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sampler = cpu.TreeCPU(proc.pid, progress=lambda: 0)
        assert set(sampler.sample()) == {"other"}
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while cpu.fleet_role(proc.pid) != "late" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(sampler.sample()) == {"late"}  # not counted under the name it had before exec
    finally:
        _finish(proc)
    assert cpu.fleet_role(proc.pid) is None


def test_machine_busy_time_covers_a_busy_child():
    b0 = cpu.cpu_busy_s()
    proc = _start(BURNER, "0.3")
    try:
        burned = float(proc.stdout.readline())
    finally:
        _finish(proc)
    assert cpu.cpu_busy_s() - b0 >= burned - 2 * TICK  # other processes only add to it
    assert cpu.own_cpu_s() >= burned - 2 * TICK  # the reaped child counts as this process's


def test_cpu_per_step_over_the_steady_window():
    samples = [
        (0, {"trainer": 5.0}),  # before row `skip`: start-up and SFT
        (3, {"trainer": 10.0, "rollout-0": 1.0}),  # first sample holding row skip=2
        (5, {"trainer": 10.4, "rollout-0": 1.2}),
        (13, {"trainer": 13.6, "rollout-0": 2.0}),  # last one with every role alive
        (13, {"trainer": 13.7}),
    ]  # the rollout worker exited: its last reading is lost
    got = cpu.cpu_per_step(samples, skip=2)
    assert got == pytest.approx({"trainer": 0.36, "rollout-0": 0.1})
    shutdown = samples[:4] + [(13, {"trainer": 15.0, "rollout-0": 2.5})]  # CPU after the last step
    assert cpu.cpu_per_step(shutdown, skip=2) == pytest.approx({"trainer": 0.36, "rollout-0": 0.1})
    assert cpu.cpu_per_step(samples[:1], skip=2) == {}  # never reached the window
    assert cpu.cpu_per_step([(3, {"trainer": 1.0})], skip=2) == {}  # one sample: no interval


def test_the_supervisor_is_the_areal_async_script_not_any_path_naming_it(tmp_path):
    """A checkout in a folder named areal-async (what ``git clone`` makes) puts the word in every
    worker's and test's argv; only the console script itself (or ``-m areal_async.cli``) is the supervisor."""
    wait = "import sys, time; print('ready', flush=True); time.sleep(30)"
    script = tmp_path / "bin" / "areal-async"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{wait}\n")
    script.chmod(0o755)
    checkout = tmp_path / "areal-async" / "tests" / "x.py"
    procs = [
        subprocess.Popen([str(script), "run", "cfg.yaml"], stdout=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, "-c", wait, str(checkout)], stdout=subprocess.PIPE, text=True),
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        assert [cpu.fleet_role(p.pid) for p in procs] == ["supervisor", "other"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
