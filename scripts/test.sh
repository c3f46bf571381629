#!/usr/bin/env bash
# The whole test suite, as CI runs it: setup, lint, format check, types, tests.
# Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "== ruff"; ruff check kvoffload tests benchmarks examples
echo "== ruff format"; ruff format --check kvoffload tests benchmarks examples
echo "== mypy"; mypy
echo "== redis"; eval "$(bash scripts/redis.sh start)"; trap 'bash scripts/redis.sh stop' EXIT
export KVOFFLOAD_REQUIRE_REDIS=1  # the redis tests must run here, not skip
echo "== pytest"; python -m pytest -q "$@"
