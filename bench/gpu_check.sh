#!/usr/bin/env bash
# GPU check (no vllm, no network, installs nothing): prints the machine; then the sharded
# publisher's change detection on the device (bench/gpu_changes.py: elements/s against the
# device's copy bandwidth, device->host bytes against the delta, a one-rank sharded publish of
# CUDA tensors checked against the CPU Publisher); then bench/gpu_apply.py's table for the
# in-place sparse apply on a tiny and a ~1.1B-param Llama-shaped model.
# Usage: bash bench/gpu_check.sh [extra gpu_apply.py args]   (rows also go to $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader || echo "gpu_check: no nvidia-smi on PATH"
"$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("torch", "safetensors", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} lacks {missing}; set PYTHON to one that has them")
import torch
print(f"gpu_check: python {sys.version.split()[0]} torch {torch.__version__} "
      f"cuda {torch.version.cuda} available={torch.cuda.is_available()}")
PYEOF
json_args=()
changes_args=()
if [ -n "${OUT:-}" ]; then
  json_args=(--json "$OUT/gpu_apply.json")
  changes_args=(--json "$OUT/gpu_changes.json")
fi
"$PY" bench/gpu_changes.py --device cuda "${changes_args[@]}"
exec "$PY" bench/gpu_apply.py --device cuda "${json_args[@]}" "$@"
