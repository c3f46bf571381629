#!/usr/bin/env bash
# The main job on the embedded defaults: `kvoffload simulate`.
# Usage: scripts/simulate.sh [options]   (see `kvoffload simulate --help`)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvoffload simulate "$@"
