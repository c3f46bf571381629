#!/usr/bin/env bash
# A private Redis for the test suite: loopback only, no persistence.
#   scripts/redis.sh start   installs redis-server from Debian's packages if absent,
#                            starts it on a free 127.0.0.1 port and prints
#                            `export KVOFFLOAD_REDIS_URL=... KVOFFLOAD_REDIS_DIR=...`
#                            (use: eval "$(bash scripts/redis.sh start)")
#   scripts/redis.sh stop    stops the server started above (KVOFFLOAD_REDIS_DIR) and
#                            removes its directory.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"

start() {
  if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
      echo "redis-server is not installed and this is not root: apt-get install -y redis-server" >&2
      exit 1
    fi
    echo "installing redis-server from Debian's packages" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
  fi
  local dir port
  dir=$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-redis.XXXXXX")
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid" --daemonize yes >&2
  for _ in $(seq 1 100); do  # bounded: at most ~10 s
    if [ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = PONG ]; then
      echo "export KVOFFLOAD_REDIS_URL=redis://127.0.0.1:$port/0 KVOFFLOAD_REDIS_DIR=$dir"
      return 0
    fi
    sleep 0.1
  done
  echo "redis-server did not answer on 127.0.0.1:$port; its log:" >&2
  tail -n 20 "$dir/redis.log" >&2 || true
  stop_dir "$dir"
  exit 1
}

stop_dir() {
  local dir=$1
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  stop_pidfile "$dir/redis.pid" 5
  rm -rf "$dir"
}

case "${1:-}" in
  start) start ;;
  stop) stop_dir "${KVOFFLOAD_REDIS_DIR:-}" ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
