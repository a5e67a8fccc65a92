#!/usr/bin/env bash
# `make demo-fleet`: a fleet of two hosts that share one L4 tier. It starts one redis-server and
# two `kvtier serve` processes, each with its own L3 root and both with --l4-url to that Redis,
# on free loopback ports. One `kvtier loadgen` then sends every session's turns to the two hosts
# in turn, as a load balancer without affinity would. Each agent hibernates its session during
# its tool pauses, so the next turn, on the other host, can only find the session's KV in L4.
# The report shows hits by tier (l4 included) for the whole fleet and for each host, and how the
# turns that changed hosts were served. Everything the script started is stopped when it ends,
# however it ends (an error, Ctrl-C, SIGTERM). A directory it made is removed then, all but the
# load generator's result (loadgen.json, loadgen.png), unless --keep keeps it all.
#
#   scripts/demo_fleet.sh [--seconds N] [--sessions N] [--turns N] [--dir DIR] [--keep] [--no-l4]
#   Environment: FLEET_SECONDS=60 FLEET_SESSIONS=8 FLEET_TURNS=8 FLEET_DIR= FLEET_KEEP=0
#
# --no-l4 runs the same fleet without Redis: the baseline, where a turn on the other host finds
# nothing and is recomputed (or restores only what that host already holds).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

SECONDS_RUN="${FLEET_SECONDS:-60}"
SESSIONS="${FLEET_SESSIONS:-8}"
TURNS="${FLEET_TURNS:-8}"
DIR="${FLEET_DIR:-}"
KEEP="${FLEET_KEEP:-0}"
L4=1

number() {  # number OPTION VALUE: VALUE must be a positive integer
  if ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "demo-fleet: $1 needs a positive whole number, not '$2' (see --help)" >&2
    exit 2
  fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --seconds|--sessions|--turns|--dir)
      if [ $# -lt 2 ]; then
        echo "demo-fleet: $1 needs a value (see --help)" >&2
        exit 2
      fi
      case "$1" in
        --seconds) SECONDS_RUN="$2" ;;
        --sessions) SESSIONS="$2" ;;
        --turns) TURNS="$2" ;;
        --dir) DIR="$2" ;;
      esac
      shift 2 ;;
    --keep) KEEP=1; shift ;;
    --no-l4) L4=0; shift ;;
    *) echo "demo-fleet: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
number --seconds "$SECONDS_RUN"
number --sessions "$SESSIONS"
number --turns "$TURNS"
if [ "$TURNS" -lt 2 ]; then
  echo "demo-fleet: --turns must be at least 2, or no turn changes hosts" >&2
  exit 2
fi

if [ ! -x "$BIN/kvtier" ]; then
  echo "demo-fleet: no $BIN/kvtier; run make setup (or set VENV)" >&2
  exit 1
fi
if [ "$L4" = 1 ]; then
  if ! command -v redis-server >/dev/null; then
    echo "demo-fleet: redis-server is not installed: apt-get install redis-server" \
      "(scripts/bootstrap.sh dev installs it), or run with --no-l4" >&2
    exit 1
  fi
  if ! "$BIN/kvtier" serve --help 2>/dev/null | grep -q -- "--l4-url"; then
    echo "demo-fleet: this kvtier serve has no --l4-url (no L4 tier); run with --no-l4" >&2
    exit 1
  fi
fi

# ---- what this script started, and the cleanup that stops it ------------------------------
PIDS=()        # kvtier serve processes
REDIS_PID=""
LOADGEN_PID=""
MADE_DIR=""    # a directory this script created, removed at the end unless --keep

stop_pid() {  # stop_pid PID SECONDS: SIGTERM, then SIGKILL after SECONDS
  local pid="$1" limit="$2" waited=0
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$waited" -ge $((limit * 5)) ]; then
      echo "demo-fleet: pid $pid still runs after ${limit}s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
    waited=$((waited + 1))
  done
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [ -n "$LOADGEN_PID" ]; then stop_pid "$LOADGEN_PID" 10; fi
  # Then the servers: they drain and hibernate their sessions (into L4 while Redis still runs).
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do stop_pid "$pid" 60; done
  if [ -n "$REDIS_PID" ]; then stop_pid "$REDIS_PID" 10; fi
  if [ -n "$MADE_DIR" ]; then
    if [ "$KEEP" = 1 ]; then
      echo "demo-fleet: kept $MADE_DIR (logs, L3 roots, loadgen.json)"
    elif [ -f "$MADE_DIR/loadgen.json" ]; then
      # The result the load generator printed stays; the logs, L3 roots and Redis files go.
      find "$MADE_DIR" -mindepth 1 -maxdepth 1 ! -name loadgen.json ! -name loadgen.png \
        -exec rm -rf {} +
      echo "demo-fleet: removed the logs and L3 roots (--keep keeps them); the result stays in" \
        "$MADE_DIR (loadgen.json, loadgen.png)"
    else
      rm -rf "$MADE_DIR"
    fi
  fi
  echo "demo-fleet: stopped everything it started"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  "$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ -z "$DIR" ]; then
  DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-fleet.XXXXXX")"
  MADE_DIR="$DIR"
elif [ ! -e "$DIR" ]; then
  mkdir -p "$DIR"
  MADE_DIR="$DIR"
fi
chmod 700 "$DIR"

wait_ready() {  # wait_ready PID URL LOG NAME
  for _ in $(seq 1 600); do
    if "$BIN/python" -c "import httpx,sys; sys.exit(httpx.get('$2/readyz', timeout=1).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    if ! kill -0 "$1" 2>/dev/null; then
      echo "demo-fleet: $4 exited; its log ($3):" >&2
      cat "$3" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "demo-fleet: $4 not ready after 120 s; its log: $3" >&2
  exit 1
}

L4_ARGS=()
if [ "$L4" = 1 ]; then
  RPORT="$(free_port)"
  mkdir -p "$DIR/redis"
  # Bounded and evicting, as `kvtier doctor --l4-url` recommends; no persistence for a demo.
  redis-server --port "$RPORT" --bind 127.0.0.1 --dir "$DIR/redis" --logfile "$DIR/redis.log" \
    --save "" --appendonly no --maxmemory 512mb --maxmemory-policy allkeys-lru \
    >/dev/null 2>&1 &
  REDIS_PID=$!
  L4_URL="redis://127.0.0.1:$RPORT/0"
  for try in $(seq 1 100); do
    "$BIN/python" -c "import socket,sys; s=socket.create_connection(('127.0.0.1',$RPORT),1); s.sendall(b'PING\r\n'); sys.exit(s.recv(16)[:5] != b'+PONG')" 2>/dev/null && break
    if ! kill -0 "$REDIS_PID" 2>/dev/null || [ "$try" = 100 ]; then
      echo "demo-fleet: redis-server did not start; its log:" >&2
      cat "$DIR/redis.log" >&2 || true
      exit 1
    fi
    sleep 0.1
  done
  echo "demo-fleet: redis-server on $L4_URL (pid $REDIS_PID, maxmemory 512mb, allkeys-lru)"
  L4_ARGS=(--l4-url "$L4_URL")
fi

URLS=()
for host in a b; do
  port="$(free_port)"
  url="http://127.0.0.1:$port"
  log="$DIR/serve-$host.log"
  "$BIN/kvtier" serve --port "$port" --l3-root "$DIR/l3-$host" --l1-bytes 48MiB --l2-bytes 8MiB \
    --l3-max-bytes 512MB --max-concurrency 8 --queue-timeout 120 "${L4_ARGS[@]+"${L4_ARGS[@]}"}" \
    >"$log" 2>&1 &
  PIDS+=($!)
  URLS+=("$url")
  echo "demo-fleet: host $host: kvtier serve on $url (pid $!, L3 $DIR/l3-$host); log $log"
done
for i in 0 1; do
  wait_ready "${PIDS[$i]}" "${URLS[$i]}" "$DIR/serve-$([ "$i" = 0 ] && echo a || echo b).log" \
    "kvtier serve on ${URLS[$i]}"
done
echo "demo-fleet: hosts ready"

echo "demo-fleet: loadgen: $SESSIONS sessions, $TURNS turns each, for at most ${SECONDS_RUN}s;" \
  "each session's turns alternate between the two hosts"
# In the background and waited for, so that a SIGTERM to this script is handled at once (bash
# runs a trap only after the foreground command it waits for has finished).
"$BIN/kvtier" loadgen --url "${URLS[0]}" --url "${URLS[1]}" --sessions "$SESSIONS" \
  --turns "$TURNS" --think-ms 1500 --user-chars 100 --tool-chars 150 --max-tokens 16 \
  --duration "$SECONDS_RUN" --hibernate-during-tools --compare 4 \
  --out "$DIR/loadgen.json" --png "$DIR/loadgen.png" &
LOADGEN_PID=$!
wait "$LOADGEN_PID"
LOADGEN_PID=""

echo
"$BIN/python" - "$DIR/loadgen.json" <<'EOF'
import json
import sys
from collections import Counter

result = json.load(open(sys.argv[1]))
moved = [s for s in result["samples"] if s["turn"] >= 1 and s["error"] is None]
by = Counter(s["source"] for s in moved)
parts = ", ".join(f"{n} from {src}" if src != "recompute" else f"{n} recomputed" for src, n in by.most_common())
print(f"demo-fleet: {len(moved)} turns landed on the other host than the turn before: {parts or 'none'}")
EOF
