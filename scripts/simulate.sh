#!/usr/bin/env bash
# The main job on the embedded defaults. Usage: scripts/simulate.sh [options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
