"""Every bad input of tests/unit/config/test_preflight.py's table through the real command line, one fresh
``python -m areal_async.cli`` each: the one line it prints, its exit code and the seconds it took to
refuse (interpreter start included). Prints a Markdown table; ``--json`` one JSON object per case.

    python -m benchmarks.preflight_refusals [--json]

Nothing is started: every case must exit 2 with one stderr line and leave no run directory (the
script says so per row). Figures depend on the machine's load: the load average is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.unit.config.test_preflight import BAD, Bad, _files

ROOT = Path(__file__).resolve().parents[1]


def refuse(bad: Bad, tmp: Path) -> dict:
    """Run one case; its line, exit code, seconds, and whether it kept the rules."""
    args = bad.args(tmp)
    run_dir = tmp / "runs" / bad.name.replace(" ", "_")
    cmd = [sys.executable, "-m", "areal_async.cli", bad.cmd, bad.config]
    cmd += ([] if "--run-dir" in args else ["--run-dir", str(run_dir)]) + args
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(tmp), str(ROOT)]))
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    took = time.monotonic() - t
    line = proc.stderr.strip()
    kept = (
        proc.returncode == 2
        and proc.stderr.count("\n") == 1
        and bad.fragment(tmp) in line
        and "Traceback" not in proc.stderr
        and not run_dir.exists()
    )
    shown = " ".join(a if len(a) < 60 else "..." + a[-40:] for a in args)
    return {
        "case": bad.name,
        "input": f"{bad.cmd} {Path(bad.config).name} {shown}",
        "line": line,
        "exit": proc.returncode,
        "seconds": round(took, 2),
        "as_expected": kept,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="preflight-") as d:
        tmp = Path(d)
        _files(tmp)
        rows = [refuse(b, tmp) for b in BAD]
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        print("| # | bad input | the one line printed (stderr) | exit | s | ok |\n|---|---|---|---|---|---|")
        for i, r in enumerate(rows, 1):
            line = r["line"].replace("|", "\\|").replace(d, "$TMP")
            case = r["input"].replace("|", "\\|").replace(d, "$TMP")
            ok = "yes" if r["as_expected"] else "NO"
            print(f"| {i} | `{case}` | `{line}` | {r['exit']} | {r['seconds']:.2f} | {ok} |")
    secs = sorted(r["seconds"] for r in rows)
    print(
        f"{len(rows)} cases, {sum(r['as_expected'] for r in rows)} as expected; seconds to refuse: "
        f"median {secs[len(secs) // 2]:.2f}, max {secs[-1]:.2f}",
        file=sys.stderr,
    )
    return 0 if all(r["as_expected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
