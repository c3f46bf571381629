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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # torch is pinned to the CPU build in pyproject.toml (torch==2.13.0).
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
