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
echo "== graphviz"  # the svg/png test needs Graphviz's dot; best effort (skipped with the reason if absent)
if ! command -v dot >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null 2>&1; }) ||
    echo "graphviz could not be installed: the svg/png test will skip" >&2
fi
echo "== redis"; eval "$(bash scripts/redis.sh start)"; trap 'bash scripts/redis.sh stop' EXIT
export KVOFFLOAD_REQUIRE_REDIS=1  # the redis tests must run here, not skip
echo "== prometheus"; eval "$(bash scripts/prometheus.sh start)"  # loopback; scrapes tests/metrics' runs
trap 'bash scripts/prometheus.sh stop; bash scripts/redis.sh stop' EXIT
export KVOFFLOAD_REQUIRE_PROMETHEUS=1  # the Prometheus scrape test must run here, not skip
# Mooncake Store: master + memory server on loopback (mooncake.sh installs Debian's
# libibverbs1 first when it is missing, as graphviz above); its tests must run, not skip.
echo "== mooncake"; eval "$(bash scripts/mooncake.sh start)"
trap 'bash scripts/mooncake.sh stop; bash scripts/prometheus.sh stop; bash scripts/redis.sh stop' EXIT
export KVOFFLOAD_REQUIRE_MOONCAKE=1
echo "== pytest"; python -m pytest -q "$@"
# SGLang's real classes (a second environment, CPU only: scripts/setup_sglang.sh). The
# integration tests run again there, where the real-class tests must run, not skip.
echo "== sglang"; bash scripts/setup_sglang.sh
KVOFFLOAD_REQUIRE_SGLANG=1 .venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/integrations
# vLLM's CPU build (a third environment: scripts/setup_vllm.sh). tests/vllm start real
# engine processes on a tiny dummy-weight model; here they must run, not skip.
echo "== vllm"; bash scripts/setup_vllm.sh
KVOFFLOAD_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm
