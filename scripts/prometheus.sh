#!/usr/bin/env bash
# A private Prometheus for the test suite: loopback only, storage in a temp directory.
#   scripts/prometheus.sh start   installs Debian's prometheus package if absent (its own
#                                 service is kept from starting), starts a server on a
#                                 free 127.0.0.1 port and prints
#                                 `export KVOFFLOAD_PROMETHEUS_URL=... KVOFFLOAD_PROMETHEUS_DIR=...`
#                                 (use: eval "$(bash scripts/prometheus.sh start)")
#   scripts/prometheus.sh stop    stops the server started above (KVOFFLOAD_PROMETHEUS_DIR)
#                                 and removes its directory.
# It scrapes every target listed in $KVOFFLOAD_PROMETHEUS_DIR/targets/*.json (Prometheus's
# file service discovery: a test writes one there for the endpoint it starts) each second.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"

install() {
  if [ "$(id -u)" != 0 ]; then
    echo "prometheus is not installed and this is not root: apt-get install -y prometheus" >&2
    exit 1
  fi
  echo "installing prometheus from Debian's packages" >&2
  # The package would start its own service (on 0.0.0.0:9090): policy-rc.d says no
  # while it installs (only when none is there already; then it is removed again).
  local policy=/usr/sbin/policy-rc.d made=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    made=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2; }; } || rc=$?
  [ -n "$made" ] && rm -f "$policy"
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true  # (never left listening on 0.0.0.0)
  fi
  return "$rc"
}

start() {
  command -v prometheus >/dev/null 2>&1 || install
  local dir port
  dir=$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-prometheus.XXXXXX")
  mkdir -p "$dir/targets" "$dir/data"
  cat >"$dir/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvoffload
    file_sd_configs:
      - files: ['$dir/targets/*.json']
        refresh_interval: 1s
EOF
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
    --web.listen-address="127.0.0.1:$port" --storage.tsdb.retention.time=1d \
    >"$dir/prometheus.log" 2>&1 </dev/null &
  echo $! >"$dir/prometheus.pid"
  for _ in $(seq 1 300); do  # bounded: at most ~30 s
    if python3 - "$port" <<'EOF' 2>/dev/null; then
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/-/ready", timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
      echo "export KVOFFLOAD_PROMETHEUS_URL=http://127.0.0.1:$port KVOFFLOAD_PROMETHEUS_DIR=$dir"
      return 0
    fi
    kill -0 "$(cat "$dir/prometheus.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "prometheus did not answer on 127.0.0.1:$port; its log:" >&2
  tail -n 20 "$dir/prometheus.log" >&2 || true
  stop_dir "$dir"
  exit 1
}

stop_dir() {
  local dir=$1
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  stop_pidfile "$dir/prometheus.pid" 10
  rm -rf "$dir"
}

case "${1:-}" in
  start) start ;;
  stop) stop_dir "${KVOFFLOAD_PROMETHEUS_DIR:-}" ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
