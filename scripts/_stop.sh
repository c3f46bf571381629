# Sourced by scripts/{redis,prometheus,mooncake}.sh: stop the process whose pid is in a
# file, bounded. Usage: stop_pidfile FILE SECONDS (SIGTERM, then SIGKILL after SECONDS).
stop_pidfile() {
  local file=$1 seconds=$2 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 $((seconds * 10))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
}
