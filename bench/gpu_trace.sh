#!/usr/bin/env bash
# A real trace through the tiers (docs/benchmarks.md, "A real trace"): bench/trace_gpu.py's
# six runs (kvtier / GPU-only prefix caching / no cache, at a 24 GiB budget and the whole
# card) of one sampled slice, a 7B dummy model, in one 10-minute call. The trace is not in the
# repository: give its path.
#
#   TRACE=path/to/conversation_trace.jsonl bash bench/gpu_trace.sh [OUT]
#   SAMPLE=0.03 SPEED=10 DURATION=50 ...    the slice (defaults sized for six runs in 10 min)
#   PREFETCH=1 ...                          kvtier's row prefetches returning sessions 1 s ahead
set -uo pipefail
cd "$(dirname "$0")/.."
: "${TRACE:?set TRACE to the trace file, JSONL in the Mooncake format}"
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export OUT PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
timeout 580 python3 bench/trace_gpu.py --trace "$TRACE" --sample "${SAMPLE:-0.03}" \
  --speed "${SPEED:-10}" --duration "${DURATION:-50}" --prefetch-ahead "${PREFETCH:-0}" \
  2>&1 | tee "$OUT/trace_gpu.txt"
echo "rc=${PIPESTATUS[0]}"
