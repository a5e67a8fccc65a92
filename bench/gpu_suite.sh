#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one run, for a machine with a CUDA GPU and torch +
# transformers installed (no other project dependency is needed: the L3 checksum falls back to
# zlib's CRC-32 without the crc32c package). Each step has its own time limit so that one slow
# step cannot starve the rest; results go to OUT (default ./gpu-out), one file per step.
#
#   bash bench/gpu_suite.sh [OUT]          # every step: at most about 50 minutes (the sum of
#                                          # the steps' time limits); STEPS= runs a group
#   STEPS="tests transfer" bash bench/gpu_suite.sh
#   FLEET_CONFIGS=recompute,kvtier,kvtier FLEET_SECONDS=30 FLEET_PROFILE=1 STEPS=fleet \
#     bash bench/gpu_suite.sh    # the fleet only, with one profiled turn per configuration
#   STEPS=multigpu bash bench/gpu_suite.sh   # on two GPUs: layers across them, failover (5 minutes)
# Other fleet settings: FLEET_SYNC=stream, FLEET_CUDNN=1 (cuDNN attention on), FLEET_SESSIONS=N.
#   STEPS=concurrent bash bench/gpu_suite.sh   # the batched-serving benchmark alone (about 6 minutes)
# Its settings: CONC_SECONDS (per configuration, default 20), CONC_CONFIGS, CONC_ARGS (any other
# options of bench/fleet_concurrent.py), e.g. CONC_ARGS="--hibernate-configs kvtier,kvtier-b96-p256"
# (96 slots and 256 prompt tokens a step: the one configuration that met every 256-session
# target in one run, docs/benchmarks.md). Each configuration's line says how long it spent
# seeding its cache, capturing CUDA graphs and closing the cache, besides its window.
#
# bench/restart.py also needs the server's packages (fastapi, uvicorn, pydantic, ...); it is
# skipped with a message when they cannot be imported.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-tests weights paged breakdown transfer l3 ttft decode attention collectors interference fleet concurrent restart}"
quiet() { grep -v -E "FutureWarning|forward_call|return func|past_key_values"; }

for step in $STEPS; do
  echo "== $step"
  case "$step" in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kvtier/test_l2.py \
        tests/kvtier/test_transfer.py tests/kvtier/test_soak.py tests/kvtier/test_cache_gpu.py \
        tests/ops/test_collectors_host.py 2>&1 | tail -30 >"$OUT/gpu_tests.txt"
      # the batched serving's GPU tests (about 50 s on an H200)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kvtier/test_batching.py \
        tests/kvtier/test_batching_paged_l1.py tests/kvtier/test_cache_pages.py \
        tests/kvtier/test_paged_graphs.py tests/kvtier/test_fused.py 2>&1 | tail -30 >"$OUT/gpu_tests_batching.txt" ;;
    transfer)
      mkdir -p "$OUT/transfer"
      timeout 150 python3 bench/transfer.py --out "$OUT/transfer" --groups "${XFER_GROUPS:-8}" >"$OUT/transfer.txt" 2>&1 ;;
    l3)
      mkdir -p .l3bench
      timeout 90 python3 bench/l3_io.py --dir .l3bench --chunks 24 --rounds 3 >"$OUT/l3_io.txt" 2>&1
      rm -rf .l3bench ;;
    ttft)
      timeout 200 python3 bench/ttft.py --contexts 2048,8192 --reps 3 2>&1 | quiet >"$OUT/ttft.txt" ;;
    decode)
      timeout 90 python3 bench/decode.py --context 2048 --steps 64 --rounds 3 2>&1 | quiet >"$OUT/decode.txt" ;;
    attention)
      timeout 60 python3 bench/attention_shapes.py >"$OUT/attention.txt" 2>&1 ;;
    collectors)
      timeout 60 python3 bench/collectors.py >"$OUT/collectors.txt" 2>&1 ;;
    interference)
      mkdir -p .l3interf
      timeout 150 python3 bench/l3_interference.py --dir .l3interf --seconds 5 \
        ${INTERF_MODES:+--modes "$INTERF_MODES"} 2>&1 | quiet \
        >"$OUT/interference.txt"
      rm -rf .l3interf ;;
    fleet)
      mkdir -p "$OUT/fleet"
      n=$(echo "${FLEET_CONFIGS:-dynamic,offloaded,recompute,kvtier,kvtier-int8}" | tr , '\n' | wc -l)
      timeout $((90 + n * (${FLEET_SECONDS:-48} + 25))) python3 bench/agent_fleet.py --out "$OUT/fleet" --time-limit "${FLEET_SECONDS:-48}" \
        ${FLEET_CONFIGS:+--configs "$FLEET_CONFIGS"} ${FLEET_PROFILE:+--profile} ${FLEET_SYNC:+--sync "$FLEET_SYNC"} ${FLEET_CUDNN:+--cudnn-attention} ${FLEET_SESSIONS:+--sessions "$FLEET_SESSIONS"} 2>&1 | quiet \
        >"$OUT/fleet.txt" ;;
    weights)
      (cd bench && timeout 90 python3 weights_digest.py) >"$OUT/weights_digest.txt" 2>&1 ;;
    paged)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kvtier/test_paged_triton.py \
        tests/kvtier/test_paged_gpu.py 2>&1 | tail -15 >"$OUT/paged_tests.txt"
      timeout 200 python3 bench/paged_attention.py --sweep >"$OUT/paged_attention.txt" 2>&1 ;;
    breakdown)
      # one batched step's GPU time by kernel kind against the floors (about 40 s)
      timeout 200 python3 bench/paged_step.py --chunk 64 --breakdown 2>&1 | quiet >"$OUT/paged_step.txt" ;;
    concurrent)
      mkdir -p "$OUT/concurrent"
      # two scenarios (64 sessions; 256 with L1 for 64), 5 + 3 configurations of CONC_SECONDS each
      timeout 590 python3 bench/agent_fleet.py --concurrent --out "$OUT/concurrent" \
        --time-limit "${CONC_SECONDS:-20}" ${CONC_CONFIGS:+--configs "$CONC_CONFIGS"} \
        ${CONC_ARGS:-} 2>&1 | quiet >"$OUT/concurrent.txt" ;;
    restart)
      if python3 -c "import fastapi, uvicorn" 2>/dev/null; then
        timeout 200 python3 bench/restart.py --device cuda --repeat 3 --png "$OUT/restart.png" \
          >"$OUT/restart.txt" 2>&1
      else
        echo "restart: skipped (fastapi/uvicorn not importable here)" | tee "$OUT/restart.txt"
      fi ;;
    multigpu)
      # a host with two GPUs: not in the default STEPS; STEPS=multigpu bash bench/gpu_suite.sh
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kvtier/test_multi_gpu.py \
        2>&1 | tail -15 >"$OUT/multigpu_tests.txt"
      timeout 580 python3 bench/multi_gpu.py --out "$OUT/multi_gpu.json" >"$OUT/multigpu.txt" 2>&1
      timeout 400 python3 bench/pipeline_nccl.py >"$OUT/multigpu_pipeline.txt" 2>&1 ;;
    *) echo "unknown step $step" >&2 ;;
  esac
  tail -12 "$OUT"/"$step"*.txt 2>/dev/null || tail -12 "$OUT/gpu_tests.txt"
done
