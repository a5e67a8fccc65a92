#!/usr/bin/env bash
# The GPU budget under a burst of arrivals (docs/benchmarks.md, "A burst of arrivals"): the real
# server over HTTP (`python -m kvtier.server --load-format dummy`, a Qwen2-7B shape), every
# session's first turn (about 3,000 prompt tokens) arriving within 2 s, 64-token replies with
# think time; beside each burst the same fleet with its first turns spread over 20 s (the
# staggered baseline), on the same card in the same call. nvidia-smi is sampled all the while.
#
#   bash bench/gpu_burst.sh [OUT]                    # every step: about 10 minutes
#   STEPS="whole" bash bench/gpu_burst.sh            # the server's defaults, 64 sessions
#   STEPS="gpu24" bash bench/gpu_burst.sh            # a 24 GiB GPU with the quickstart's flags,
#                                                    # 128 sessions
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-whole gpu24}"
ARRIVALS="${ARRIVALS:-burst stagger}"  # "burst" alone: no staggered baseline
SECONDS_RUN="${SECONDS_RUN:-45}"
FLEET="--turns 20 --think-ms 200 --system-chars 2900 --user-chars 60 --tool-chars 60"
# the quickstart's 24 GB flags (docs/quickstart.md): 0.95 of a 24 GiB card, a 512-token step,
# 32 GiB of L2
GPU24="--gpu-memory-gb 22.8 --serve-arg=--batch-tokens=512 --serve-arg=--l2-bytes=32GiB"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
for step in $STEPS; do
  case "$step" in
    whole) args="--sessions 64"; n=64 ;;
    gpu24) args="--sessions 128 $GPU24"; n=128 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  for arrival in $ARRIVALS; do
    echo "== $step $arrival $(date +%T)"
    if [ "$arrival" = burst ]; then how="--burst 2"; else how="--ramp 20"; fi
    timeout 280 python3 bench/serve_http.py $args $FLEET $how --duration "$SECONDS_RUN" \
      --out "$OUT/$step-$arrival" >"$OUT/$step-$arrival.txt" 2>&1
    echo "exit $?" >>"$OUT/$step-$arrival.txt"
    tail -14 "$OUT/$step-$arrival.txt"
  done
done
