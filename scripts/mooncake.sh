#!/usr/bin/env bash
# A private Mooncake Store for the test suite, on loopback only.
#   scripts/mooncake.sh start   installs Debian's libibverbs1 if absent (root only), then
#                               starts mooncake_master (RPC and metrics on 127.0.0.1, free
#                               ports, a 200 ms read lease, no HTTP metadata server) and a
#                               mooncake_client memory server lending it 512 MB (P2P
#                               handshake: no etcd, no metadata server), and prints
#                               `export KVOFFLOAD_MOONCAKE_URL=... KVOFFLOAD_MOONCAKE_DIR=...`
#                               (use: eval "$(bash scripts/mooncake.sh start)")
#   scripts/mooncake.sh stop    stops both (KVOFFLOAD_MOONCAKE_DIR) and removes the directory.
# The binaries come with the kvoffload[mooncake] extra (scripts/setup.sh installs it in
# .venv); MOONCAKE_BIN overrides where they are looked for.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"
cd "$(dirname "$0")/.."

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

listening() {  # port: whether 127.0.0.1:port accepts a connection
  python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.5).close()' "$1" 2>/dev/null
}

start() {
  if ! python3 -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null; then
    if [ "$(id -u)" != 0 ]; then
      echo "libibverbs1 is not installed and this is not root: apt-get install -y libibverbs1" >&2
      exit 1
    fi
    echo "installing libibverbs1 from Debian's packages" >&2
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >&2 ||
      { DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >&2; })
  fi
  local bin=${MOONCAKE_BIN:-}
  if [ -z "$bin" ]; then
    local py=python3
    [ -x .venv/bin/python ] && py=.venv/bin/python
    bin=$("$py" -c 'import mooncake, os; print(os.path.dirname(list(mooncake.__path__)[0] + "/x"))' 2>/dev/null) || {
      echo "Mooncake is not installed: pip install 'kvoffload[mooncake]' (scripts/setup.sh does)" >&2
      exit 1
    }
  fi
  local dir port mport cport
  dir=$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-mooncake.XXXXXX")
  port=$(free_port); mport=$(free_port); cport=$(free_port)
  setsid "$bin/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$port" \
    --metrics_host=127.0.0.1 --metrics_port="$mport" --default_kv_lease_ttl=200 \
    --client_ttl=3 --rpc_thread_num=2 >"$dir/master.log" 2>&1 </dev/null &
  echo $! >"$dir/master.pid"
  wait_for "$dir" "$port" master
  setsid "$bin/mooncake_client" --host=127.0.0.1 --metadata_server=P2PHANDSHAKE \
    --master_server_address="127.0.0.1:$port" --port="$cport" --global_segment_size=512MB \
    --protocol=tcp >"$dir/memory.log" 2>&1 </dev/null &
  echo $! >"$dir/memory.pid"
  wait_for "$dir" "$cport" memory
  echo "export KVOFFLOAD_MOONCAKE_URL=mooncake://127.0.0.1:$port KVOFFLOAD_MOONCAKE_DIR=$dir"
}

wait_for() {  # dir port name: wait (bounded, ~15 s) until the child listens
  local dir=$1 port=$2 name=$3
  for _ in $(seq 1 150); do
    if listening "$port"; then return 0; fi
    kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "mooncake $name did not come up on 127.0.0.1:$port; its log:" >&2
  tail -n 20 "$dir/$name.log" >&2 || true
  stop_dir "$dir"
  exit 1
}

stop_dir() {
  local dir=$1 name
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  for name in memory master; do
    stop_pidfile "$dir/$name.pid" 5
  done
  rm -rf "$dir"
}

case "${1:-}" in
  start) start ;;
  stop) stop_dir "${KVOFFLOAD_MOONCAKE_DIR:-}" ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
