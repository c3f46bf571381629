#!/usr/bin/env bash
# Create (or reuse) .venv and install kvoffload with its test and dev tools.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvoffload-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # pyproject.toml accepts torch>=2.3 (what the user's engine brings); CI pins the CPU
  # build on this machine's disk through the constraints file (a plain `torch` would
  # pull a multi-GB CUDA build).
  # mooncake: the Mooncake Store tier's client and master (CPU build; its import needs
  # Debian's libibverbs1, which scripts/test.sh installs).
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev,mooncake]"
  touch "$stamp"
fi
