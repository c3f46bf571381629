#!/usr/bin/env bash
# Create (or reuse) .venv-sglang: kvoffload beside SGLang 0.5.23's real classes, CPU only.
# SGLang's own dependency list pins a CUDA torch and GPU kernels (flashinfer, sglang-kernel,
# cutlass): it is installed with --no-deps, beside torch==2.13.0+cpu, triton (imported by
# SGLang's memory pools; it imports without a GPU) and the pure-Python packages its import
# chain executes (scripts/sglang-requirements.txt). What is GPU-only and imported anyway
# is stubbed at import time by tests/integrations/sglang_cpu.py (torchvision only).
# Idempotent: a second run only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-sglang
if [ ! -x $V/bin/python ]; then
  "$PY" -m venv $V
fi
stamp=$V/.kvoffload-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/sglang-requirements.txt -nt "$stamp" ] ||
  [ scripts/constraints.txt -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  $V/bin/python -m pip install -q --upgrade pip >/dev/null
  # pip warns of each index location this machine lacks; those lines are noise here
  $V/bin/python -m pip install -q -c scripts/constraints.txt torch numpy triton==3.9.0
  $V/bin/python -m pip install -q --no-deps sglang==0.5.23
  $V/bin/python -m pip install -q --no-deps -r scripts/sglang-requirements.txt
  $V/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"
  touch "$stamp"
fi
