"""A process that reports what it was started as: ``python -m tests.support.fork_probe OUT [EXIT] [--sleep S]``.

Writes OUT (JSON): its argv, /proc cmdline, environment, directory, session and group, stdin's target,
signal dispositions, whether the garbage collector is on; prints one line to stdout and one to stderr (the
log shows where they went); a non-daemon thread writes OUT + ".thread" just before the interpreter ends
(joined at exit), and an ``atexit`` handler writes OUT + ".atexit" after it. Exit status EXIT (default 0).
With ``--sleep S`` it sleeps first (a process to signal). Used by tests/unit/supervisor/test_forkserver.py
to compare a child forked by the fork server with the same command started by ``subprocess.Popen``.
"""

import atexit
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    args = sys.argv[1:]
    if "--sleep" in args:
        i = args.index("--sleep")
        time.sleep(float(args[i + 1]))
        args = args[:i] + args[i + 2 :]
    out, code = Path(args[0]), int(args[1]) if len(args) > 1 else 0
    report = {
        "argv": sys.argv,
        "cmdline": Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0"),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "signals": {s.name: _disposition(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)},
        "name": __name__,
        "gc_enabled": gc.isenabled(),
    }
    report["cmdline"] = [a.decode() for a in report["cmdline"]]
    out.write_text(json.dumps(report))
    print("probe stdout")
    print("probe stderr", file=sys.stderr)
    atexit.register(lambda: Path(f"{out}.atexit").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), Path(f"{out}.thread").write_text("joined"))).start()
    return code


def _disposition(sig) -> str:
    h = signal.getsignal(sig)
    return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignore", signal.default_int_handler: "int"}.get(h, "python")


if __name__ == "__main__":
    sys.exit(main())
