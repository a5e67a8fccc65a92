#!/usr/bin/env bash
# The GPU memory budget's runs, for a machine with a CUDA GPU (docs/benchmarks.md, "On a 24 GB
# GPU"). Each step has its own time limit and writes its output under OUT (default
# ./gpu-out), one file per step; STEPS= picks steps.
#
#   bash bench/gpu_budget.sh [OUT]                       # every step: about 20 minutes
#   STEPS="a10" bash bench/gpu_budget.sh                   # the A10 table at 24, 48 GiB and whole
#   STEPS="http24 http" bash bench/gpu_budget.sh           # the server over HTTP, 24 GiB and whole
#
# Steps:
#   tests    the budget's GPU tests (256 sessions committed into a tiny L2 under the budget; the
#            paged L1's batch)
#   a10      bench/small_gpu.py at 24 and 48 GiB and the whole device (about 8 minutes)
#   a10-24   128 sessions at 24 GiB alone, L2 holding the fleet (0.95 of the cap, L2 32 GiB,
#            a 512-token step: smaller graphs, a larger pool); all-on-GPU at 24 and 32 only
#   http24   bench/serve_http.py: 64 agent sessions over HTTP, --load-format dummy, the server
#            as a 24 GiB GPU (--gpu-memory-utilization) with 32 GiB of L2, --batch-tokens 512
#   http     the same on the whole device with default settings but the budget flag, like for
#            like with the in-process fleet (64-token replies, ~180 tokens a turn, 20 turns)
#   fleet    bench/agent_fleet.py --concurrent: 64 sessions and the 256-session hibernate
#            scenario with the pool sized once from L1 for 64
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-tests a10 http24 http fleet}"
HTTP_SECONDS="${HTTP_SECONDS:-60}"
# the HTTP fleet like for like with the in-process fit scenario (bench/fleet_concurrent.py):
# 64-token replies (ignore_eos), think 30-90 ms (its 20-100 ms), prompts growing about 190
# tokens a turn from about 1,350 (its contexts: 3,000 tokens growing to at most 4,024), 20 turns
# so that the steady window (after every first turn) spans most of them
HTTP_FLEET="--sessions 64 --turns 20 --think-ms 60 --system-chars 1200 --user-chars 60 --tool-chars 60"

for step in $STEPS; do
  echo "== $step $(date +%T)"
  case "$step" in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/kvtier/test_cache_backpressure.py tests/kvtier/test_batching_paged_l1.py \
        tests/kvtier/test_server_device_fault.py 2>&1 | tail -30 >"$OUT/gpu_tests_budget.txt" ;;
    a10)
      timeout 590 python3 bench/small_gpu.py --out "$OUT/a10" >"$OUT/a10.txt" 2>&1 ;;
    a10-24)
      timeout 400 python3 bench/small_gpu.py --caps 24 --sessions 128 --gpu-memory-utilization 0.95 \
        --l2-gb 32 --batch-tokens 512 --search-time 4 --time-limit 14 --batches 24,32 --first 24 \
        --out "$OUT/a10-24" >"$OUT/a10-24.txt" 2>&1 ;;
    http24)
      # on a 24 GiB budget with a 512-token step (a larger pool) and 32 GiB of L2
      timeout 400 python3 bench/serve_http.py --gpu-memory-gb 24 $HTTP_FLEET \
        --duration "$HTTP_SECONDS" --serve-arg=--l2-bytes=32GiB \
        --serve-arg=--batch-tokens=512 --out "$OUT/http24" \
        ${HTTP_CEILING:+--in-process-toks "$HTTP_CEILING"} >"$OUT/http24.txt" 2>&1 ;;
    http)
      # the whole device, the server's defaults but the budget flag
      timeout 400 python3 bench/serve_http.py $HTTP_FLEET --duration "$HTTP_SECONDS" \
        --out "$OUT/http" ${HTTP_CEILING:+--in-process-toks "$HTTP_CEILING"} >"$OUT/http.txt" 2>&1 ;;
    fleet)
      timeout 590 python3 bench/agent_fleet.py --concurrent --sessions 64 --hibernate-sessions 256 \
        --l1-sessions 64 --l2-factor 3.5 --time-limit 9 --think-hibernate 2.34,3.90 \
        --configs ceiling,kvtier --hibernate-configs kvtier-b96-p256 \
        >"$OUT/fleet.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "   rc=$? $(date +%T)"
done
