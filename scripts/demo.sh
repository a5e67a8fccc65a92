#!/usr/bin/env bash
# `make demo`: start kvtier serve with the built-in model and a small L1 (so sessions really move
# down to L2 and L3), drive it with a fleet of agent sessions for about a minute, print the report,
# then leave the server running for kvtop (or stop it cleanly with DEMO_EXIT=1).
#   DEMO_PORT=8000  DEMO_SECONDS=60  DEMO_SESSIONS=32  DEMO_EXIT=1  DEMO_KEEP_RUNS=5
# `make demo-clean` (scripts/demo.sh clean): stop a demo server still running, delete its files.
#
# Each run starts with an empty L3: the load generator names its sessions after a fresh run id, so
# an earlier run's hibernated sessions would never be used again and the L3 would only grow. The
# L3 therefore holds one run at most; the newest DEMO_KEEP_RUNS run directories (log, JSON, PNG)
# are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
PORT="${DEMO_PORT:-8000}"
SECONDS_RUN="${DEMO_SECONDS:-60}"
SESSIONS="${DEMO_SESSIONS:-32}"
KEEP_RUNS="${DEMO_KEEP_RUNS:-5}"
URL="http://127.0.0.1:$PORT"

# Everything the demo writes lives in a private directory under the user's data dir.
DATA="$("$BIN/python" -c 'import platformdirs; print(platformdirs.user_data_dir("kvtier", appauthor=False))')/demo"
PIDFILE="$DATA/serve.pid"

# The pid of a demo server that still runs, else nothing (a stale pid file is removed).
running_pid() {
  [ -f "$PIDFILE" ] || return 0
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -qa "serve" "/proc/$pid/cmdline" 2>/dev/null; then
    echo "$pid"
  else
    rm -f "$PIDFILE"
  fi
}

stop_and_wait() {
  kill -TERM "$1" 2>/dev/null || true
  while kill -0 "$1" 2>/dev/null; do sleep 0.2; done
  rm -f "$PIDFILE"
}

if [ "${1:-}" = "clean" ]; then
  pid="$(running_pid)"
  if [ -n "$pid" ]; then
    echo "demo-clean: stopping the demo server (pid $pid)"
    stop_and_wait "$pid"
  fi
  if [ -d "$DATA" ]; then
    echo "demo-clean: removing $DATA ($(du -sh "$DATA" | cut -f1))"
    rm -rf "$DATA"
  else
    echo "demo-clean: nothing to remove ($DATA does not exist)"
  fi
  exit 0
fi

pid="$(running_pid)"
if [ -n "$pid" ]; then
  echo "demo: a demo server still runs (pid $pid) on the demo's L3; stop it with" \
    "kill -TERM $pid or make demo-clean" >&2
  exit 1
fi
if "$BIN/python" -c "import httpx,sys; httpx.get('$URL/healthz', timeout=1); sys.exit(0)" 2>/dev/null; then
  echo "demo: something already answers on $URL; stop it or set DEMO_PORT" >&2
  exit 1
fi

mkdir -p -m 700 "$DATA"
if [ -d "$DATA/l3" ]; then
  echo "demo: emptying the L3 of the previous run ($(du -sh "$DATA/l3" | cut -f1))"
  rm -rf "$DATA/l3"
fi
# Old runs' directories beyond the newest KEEP_RUNS - 1 (this run makes one more).
{ ls -1d "$DATA"/run-* 2>/dev/null || true; } | sort | head -n "-$((KEEP_RUNS > 0 ? KEEP_RUNS - 1 : 0))" |
  while read -r old; do rm -rf "$old"; done
RUN="$DATA/run-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"

echo "demo: starting kvtier serve on $URL (L1 48 MiB, L2 8 MiB, L3 $DATA/l3); log $RUN/serve.log"
# 8 slots for 32 agents: turns queue for a slot, and the shortest prompts first free them sooner
# (--prompt-order shortest: 148-156 against 138-141 tok/s on 2 CPUs, docs/configuration.md)
setsid "$BIN/kvtier" serve --port "$PORT" --l3-root "$DATA/l3" --l1-bytes 48MiB --l2-bytes 8MiB --l3-max-bytes 512MB \
  --max-concurrency 8 --prompt-order shortest --queue-timeout 120 >"$RUN/serve.log" 2>&1 &
PID=$!
echo "$PID" >"$PIDFILE"
# The pid file goes when the server exits, however it is stopped (kill -TERM, a crash):
# a detached watcher waits for the process and removes the file if it still names it.
setsid bash -c 'tail --pid="$1" -f /dev/null; [ "$(cat "$2" 2>/dev/null)" = "$1" ] && rm -f "$2"' \
  _ "$PID" "$PIDFILE" </dev/null >/dev/null 2>&1 &
for _ in $(seq 1 300); do
  if "$BIN/python" -c "import httpx,sys; sys.exit(httpx.get('$URL/readyz', timeout=1).status_code != 200)" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$PID" 2>/dev/null; then
    echo "demo: the server exited; its log:" >&2
    cat "$RUN/serve.log" >&2
    rm -f "$PIDFILE"
    exit 1
  fi
  sleep 0.2
done

echo "demo: $SESSIONS agent sessions for ${SECONDS_RUN}s (shared system prompt, tool pauses)"
"$BIN/kvtier" loadgen --url "$URL" --sessions "$SESSIONS" --turns 15 --think-ms 1500 \
  --user-chars 100 --tool-chars 150 --max-tokens 24 --duration "$SECONDS_RUN" --compare 8 \
  --out "$RUN/loadgen.json" --png "$RUN/loadgen.png"

echo
echo "demo: check this host for the demo's L3 with"
echo "      $BIN/kvtier doctor --l3-root $DATA/l3"
if [ "${DEMO_EXIT:-0}" = "1" ]; then
  stop_and_wait "$PID"
  echo "demo: server drained (every session hibernated to L3) and stopped"
else
  echo "demo: the server keeps running (pid $PID). Watch it:  $BIN/kvtop --url $URL"
  echo "      stop it cleanly:  kill -TERM $PID   (sessions are hibernated to L3 and resume on restart)"
  echo "      stop it and delete the demo's files:  make demo-clean"
fi
