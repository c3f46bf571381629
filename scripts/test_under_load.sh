#!/usr/bin/env bash
# The whole suite (scripts/test.sh) with every CPU core busy, N times in a row (FAILURES
# F39: no test may depend on how fast the machine runs). The load is one busy loop a
# core (`yes > /dev/null`), or stress-ng when it is installed; it stops when this
# script exits, however it exits. One summary line a run; exit 1 if any run failed.
# Usage: scripts/test_under_load.sh [N=3] [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
shift || true
case $runs in '' | *[!0-9]* | 0) echo "usage: $0 [N>=1] [pytest args]" >&2; exit 2 ;; esac
cores=$(nproc 2>/dev/null || echo 2)
loaders=()
stop_load() {
  for pid in "${loaders[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${loaders[@]}"; do wait "$pid" 2>/dev/null; done
  loaders=()
}
trap stop_load EXIT
trap 'stop_load; exit 130' INT
trap 'stop_load; exit 143' TERM
if command -v stress-ng >/dev/null; then
  stress-ng --cpu "$cores" --quiet >/dev/null 2>&1 &
  loaders+=($!)
  load="stress-ng --cpu $cores"
else
  for _ in $(seq "$cores"); do
    yes >/dev/null &
    loaders+=($!)
  done
  load="$cores x yes"
fi
echo "load: $load (pids ${loaders[*]})"
failed=0
summary=()
for i in $(seq "$runs"); do
  log=$(mktemp "${TMPDIR:-/tmp}/kvoffload-under-load-$i.XXXXXX")
  start=$(date +%s)
  bash scripts/test.sh "$@" >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  result=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|error)' "$log" | tail -1)
  [ "$rc" = 0 ] || failed=1
  line="run $i/$runs: exit $rc in ${secs}s under $load: ${result:-no pytest summary (see $log)}"
  [ "$rc" = 0 ] && rm -f "$log" || line="$line; log: $log"
  echo "$line"
  summary+=("$line")
done
stop_load
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
