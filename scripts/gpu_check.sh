#!/usr/bin/env bash
# The GPU check: one JSON line per check ({"name", "status": pass|fail|skipped, "detail", "seconds", "data"}),
# exit status 1 when any check failed. The checks are benchmarks/gpu_check (registry.CHECKS; `--list` names
# them); on a machine without CUDA those that need it print "skipped: no CUDA" and the rest run.
#
# Runs unchanged on a bare single-GPU box with nothing carried: python3 (3.12) with a CUDA torch, cupy-cuda13x
# (for the NCCL checks), transformers and pytest, no network. The checks of GPU code import neither pyzmq nor
# msgpack; the two that start a fleet or use the run's store (one_gpu_run, nccl_run_store) need both and are
# skipped without them ("skipped: pyzmq missing"). To run those too, carry their wheels in .whl/ (git-ignored:
# name it when carrying the checkout); missing packages are unpacked from there into .gpu_check_site/ (on
# PYTHONPATH; the system's python is not touched). Fill .whl/ on a machine with network, for the box's python:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl pyzmq msgpack
#
# vllm_weight_transfer runs with VLLM_PYTHON (a CUDA vLLM environment's interpreter), else is skipped.
# Budget: the runner stops starting checks after 450 s (registry.BUDGET_S), each check has its own timeout;
# the whole run stays under 8 minutes. Arguments go to the runner: --only a,b  --list  --cpu-twins
# (run the CUDA checks' CPU twins)  --in-process (no child per check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHL=${WHL:-.whl}
SITE=$PWD/.gpu_check_site
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$SITE"

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
for pkg in $missing; do
    whl=$(find "$WHL" -maxdepth 1 -iname "$pkg-*.whl" 2>/dev/null | sort | tail -n 1)
    if [ -z "$whl" ]; then
        echo "gpu_check: $pkg is not installed and $WHL/ has no wheel of it: the checks that need it are skipped" >&2
        continue
    fi
    mkdir -p "$SITE"
    "$PY" -m zipfile -e "$whl" "$SITE" || echo "gpu_check: could not unpack $whl" >&2
done
exec timeout 480 "$PY" -m benchmarks.gpu_check "$@"
