#!/usr/bin/env bash
# `make demo`: start kvtier serve with the built-in model and a small L1 (so sessions really move
# down to L2 and L3), drive it with a fleet of agent sessions for about a minute, print the report,
# then leave the server running for kvtop (or stop it cleanly with DEMO_EXIT=1).
#   DEMO_PORT=8000  DEMO_SECONDS=60  DEMO_SESSIONS=32  DEMO_EXIT=1
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT="${DEMO_PORT:-8000}"
SECONDS_RUN="${DEMO_SECONDS:-60}"
SESSIONS="${DEMO_SESSIONS:-32}"
URL="http://127.0.0.1:$PORT"

# Everything the demo writes lives in a private directory under the user's data dir.
DATA="$("$BIN/python" -c 'import platformdirs; print(platformdirs.user_data_dir("kvtier", appauthor=False))')/demo"
mkdir -p -m 700 "$DATA"
RUN="$DATA/run-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"

if "$BIN/python" -c "import httpx,sys; httpx.get('$URL/healthz', timeout=1); sys.exit(0)" 2>/dev/null; then
  echo "demo: something already answers on $URL; stop it or set DEMO_PORT" >&2
  exit 1
fi

echo "demo: starting kvtier serve on $URL (L1 24 MiB, L2 8 MiB, L3 $DATA/l3); log $RUN/serve.log"
setsid "$BIN/kvtier" serve --port "$PORT" --l3-root "$DATA/l3" --l1-bytes 24MiB --l2-bytes 8MiB \
  --max-concurrency 4 --queue-timeout 120 >"$RUN/serve.log" 2>&1 &
PID=$!
echo "$PID" >"$DATA/serve.pid"
for _ in $(seq 1 300); do
  if "$BIN/python" -c "import httpx,sys; sys.exit(httpx.get('$URL/readyz', timeout=1).status_code != 200)" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$PID" 2>/dev/null; then
    echo "demo: the server exited; its log:" >&2
    cat "$RUN/serve.log" >&2
    exit 1
  fi
  sleep 0.2
done

echo "demo: $SESSIONS agent sessions for ${SECONDS_RUN}s (shared system prompt, tool pauses)"
"$BIN/kvtier" loadgen --url "$URL" --sessions "$SESSIONS" --turns 15 --think-ms 1500 \
  --user-chars 100 --tool-chars 150 --max-tokens 24 --duration "$SECONDS_RUN" --compare 8 \
  --out "$RUN/loadgen.json" --png "$RUN/loadgen.png"

echo
echo "demo: cache tiers now (from $URL/metrics):"
"$BIN/python" - "$URL" <<'PY'
import sys, httpx
text = httpx.get(sys.argv[1] + "/metrics", timeout=5).text
for line in text.splitlines():
    if line.startswith(("kvtier_tier_used_bytes", "kvtier_tier_hits", "kvtier_restore_decisions",
                        "kvtier_sessions{")):
        print("  " + line)
PY

if [ "${DEMO_EXIT:-0}" = "1" ]; then
  kill -TERM "$PID"
  while kill -0 "$PID" 2>/dev/null; do sleep 0.2; done
  rm -f "$DATA/serve.pid"
  echo "demo: server drained (every session hibernated to L3) and stopped"
else
  echo
  echo "demo: the server keeps running (pid $PID). Watch it:  $BIN/kvtop --url $URL"
  echo "      stop it cleanly:  kill -TERM $PID   (sessions are hibernated to L3 and resume on restart)"
fi
