#!/usr/bin/env bash
# The GPU check: one JSON line per check ({"name", "status": pass|fail|skipped, "detail", "seconds", "data"}),
# exit status 1 when any check failed. The checks are benchmarks/gpu_check (registry.CHECKS; `--list` names
# them); on a machine without CUDA those that need it print "skipped: no CUDA" and the rest run.
#
# Meant to run unchanged on a bare single-GPU box: python3 (3.12) with a CUDA torch, cupy-cuda13x (for the
# NCCL checks), transformers and pytest, no network. Packages the project imports that such a box lacks
# (pyzmq, msgpack, ...) are unpacked from the wheels in .whl/ into .gpu_check_site/ (put on PYTHONPATH; the
# system's python is not touched). Fill .whl/ on a machine with network, for the box's python and platform:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl pyzmq msgpack pyyaml
#
# (.whl/ is git-ignored: carry it to the box with the checkout.) Budget: the runner stops starting checks
# after 450 s (registry.BUDGET_S), each check has its own timeout; the whole run stays under 8 minutes.
# Arguments go to the runner: --only a,b  --list  --cpu-twins (run CUDA checks' CPU twins on gloo).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHL=${WHL:-.whl}
SITE=$PWD/.gpu_check_site
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "yaml": "pyyaml", "safetensors": "safetensors", "numpy": "numpy"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing $missing; unpacking from $WHL/ into $SITE" >&2
    mkdir -p "$SITE"
    for pkg in $missing; do
        whl=$(find "$WHL" -maxdepth 1 -iname "$pkg-*.whl" 2>/dev/null | sort | tail -n 1)
        if [ -z "$whl" ]; then
            echo "gpu_check: no wheel for $pkg in $WHL/ (see the pip download line at the top of this script)" >&2
            continue
        fi
        "$PY" -m zipfile -e "$whl" "$SITE" || echo "gpu_check: could not unpack $whl" >&2
    done
fi
# the environment check reports whatever is still missing (and fails), the other checks then fail on import
exec timeout 480 "$PY" -m benchmarks.gpu_check "$@"
