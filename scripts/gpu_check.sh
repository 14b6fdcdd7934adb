#!/usr/bin/env bash
# GPU checks of the tensor transport (issue 4) and the FSDP2 trainer (issue 10). Installs nothing: run it
# in an environment that already has a CUDA torch (and, for the NCCL checks, cupy-cuda12x + nvidia-nccl-cu12).
# Budget: under 6 minutes on one H200. Outputs go to ${OUT:-bench_out}.
#   1. environment report (torch/CUDA/cupy/NCCL versions, devices)
#   2. pytest -m gpu tests/gpu           (D2D bound, NCCL loopback, NCCL 2 ranks if 2 GPUs, CUDA IPC;
#                                         a 1-GPU FSDP2 PPO step in bf16 with fp32 master weights)
#   3. transfer_latency --device cuda    (cuda_ipc rows; nccl rows need 2 GPUs; D2D copy bound)
#   4. scale_model --from that JSON      (alpha/beta fitted from the GPU rows)
#   5. vLLM weight reload and NCCL weight transfer (VLLM_PYTHON; tests/gpu/vllm_weight_transfer_check.py)
#   (tests/gpu also holds the SGLang client against a real sglang.launch_server: a tiny Qwen2 built
#    locally, weights over a group and from disk with their weight_version, an interrupted sample)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

$PY - <<'PYEOF' 2>&1 | tee "$OUT/gpu_env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
try:
    import cupy
    from cupy.cuda import nccl
    print("cupy", cupy.__version__, "nccl available", nccl.available,
          "version", nccl.get_version() if nccl.available else None)
except ImportError as e:
    print("cupy not importable:", e, "(NCCL checks will be skipped)")
PYEOF

timeout 300 $PY -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1

timeout 150 $PY -m benchmarks.transfer_latency --device cuda --quick --json "$OUT/transfer_gpu.json" \
    --plot "$OUT/transfer_gpu.png" 2>&1 | tr '\r' '\n' | grep -v "case/s\|s/case" | tee "$OUT/transfer_gpu.log" || status=1

if [ -s "$OUT/transfer_gpu.json" ]; then
    $PY -m benchmarks.scale_model --from "$OUT/transfer_gpu.json" --json "$OUT/scale_gpu.json" \
        2>&1 | tee "$OUT/scale_gpu.log" || status=1
fi
# 5. vLLM weight paths (rollout.backend=vllm), in a CUDA vLLM environment: VLLM_PYTHON=/path/to/its/python.
#    disk reload (reload_weights between /pause and /resume) on GPU 0; NCCL weight transfer (vLLM's own
#    NCCLTrainerWeightTransferEngine, --weight-transfer-config) when 2 GPUs exist. Written against vLLM 0.32.0.
if [ -n "${VLLM_PYTHON:-}" ] && [ -x "$VLLM_PYTHON" ]; then
    timeout 300 "$VLLM_PYTHON" tests/gpu/vllm_weight_transfer_check.py 2>&1 | tee "$OUT/vllm_gpu.log" || status=1
else
    echo "vllm checks skipped: set VLLM_PYTHON to a CUDA vLLM environment's python" | tee "$OUT/vllm_gpu.log"
fi
exit $status
