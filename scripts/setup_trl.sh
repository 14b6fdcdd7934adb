#!/usr/bin/env bash
# Create the TRL reference environment (tests/contract/test_trl_reference.py): a venv of its own, outside
# the package's .venv, holding trl==1.16.0 beside the CPU torch 2.13.0. The test runs TRL's GRPO loss
# (GRPOTrainer._compute_loss) in this interpreter on tiny tensors and compares it with trainer/algo/loss.py;
# TRL is not a dependency of the package (its trainer module imports datasets, pandas and pyarrow).
#   default place: ${AREAL_TRL_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/areal-async/trl-1.16.0}
# Idempotent: a finished environment has a READY file (written only after the import check) and is
# left alone; a half-made one is completed. Prints the interpreter path last.
set -euo pipefail
ENV=${AREAL_TRL_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/areal-async/trl-1.16.0}
PY=${PYTHON:-python3}
if [ -f "$ENV/READY" ]; then
  echo "trl environment ready (cached): $ENV/bin/python" >&2
  echo "$ENV/bin/python"
  exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$ENV")"
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
. "$(dirname "$0")/pip_uv.sh"  # uv_pip: installs with uv (why: that file)
uv_pip "$ENV" --compile-bytecode "torch==2.13.0" "trl==1.16.0"  # the CPU torch pinned: nothing pulls a CUDA build
"$ENV/bin/python" -c "from trl.trainer.grpo_trainer import GRPOTrainer" >/dev/null
"$ENV/bin/python" -c "import importlib.metadata as m; print(m.version('trl'))" > "$ENV/READY"
echo "trl environment made in $(( $(date +%s) - start )) s, $(du -sh "$ENV" | cut -f1): $ENV/bin/python" >&2
echo "$ENV/bin/python"
