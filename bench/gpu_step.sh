#!/usr/bin/env bash
# The GPU runs of the restructured step (the cache and scheduler as parts; decode-only graphs;
# fused norms and activations), for a machine with a CUDA GPU. Each step has its own time
# limit (each fits one 10-minute call) and writes under OUT (default ./gpu-out); STEPS= picks.
#
#   bash bench/gpu_step.sh [OUT]                  # every step: at most 40 minutes
#   STEPS="breakdown" bash bench/gpu_step.sh      # one batched step by kernel kind (1 minute)
#   BUDGET_S=580 STEPS="tests tests2" bash ...     # the steps together end within 580 s
#
# Steps:
#   tests      the gpu-marked tests of the kernels, graphs (decode-only ones too), fused
#              kernels compiled, the cache and the transfers on CUDA
#   tests2     every other gpu-marked test (batching, the server, failover on one device, ops)
#   breakdown  bench/paged_step.py --breakdown: the decode-only and mixed steps, replayed with
#              and without decode-only graphs and fused kernels, against their floors
#   fleet      bench/agent_fleet.py --concurrent: fit with kvtier-unfused, kvtier-nodg and kvtier (the defaults);
#              hibernate (256 sessions, L1 for 64) with kvtier-b96-p256
#   grammar    bench/grammar_step.py: 64 sessions with and without one constrained row
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-tests tests2 breakdown fleet grammar}"
FIRST="paged or fused or cache or transfer or l2 or soak"
START=$(date +%s)
# a step's time limit: its own, or what is left of BUDGET_S (when set), if less
limit() {
  local own=$1 left
  [ -z "${BUDGET_S:-}" ] && { echo "$own"; return; }
  left=$((BUDGET_S - ($(date +%s) - START)))
  [ "$left" -lt 10 ] && left=10
  [ "$left" -lt "$own" ] && echo "$left" || echo "$own"
}
quiet() { grep -v -E "FutureWarning|forward_call|return func|past_key_values"; }

for step in $STEPS; do
  echo "== $step $(date +%T)"
  case "$step" in
    tests)
      timeout $(limit 560) python3 -m pytest -q -p no:cacheprovider -m gpu -k "$FIRST" tests/kvtier \
        2>&1 | tail -40 >"$OUT/gpu_tests_kernels.txt" ;;
    tests2)
      timeout $(limit 560) python3 -m pytest -q -p no:cacheprovider -m gpu -k "not ($FIRST)" tests/kvtier \
        tests/ops 2>&1 | tail -40 >"$OUT/gpu_tests_serving.txt" ;;
    breakdown)
      timeout $(limit 300) python3 bench/paged_step.py --chunk 64 --breakdown 2>&1 | quiet \
        >"$OUT/paged_step.txt" ;;
    fleet)
      mkdir -p "$OUT/step_fleet"
      timeout $(limit 580) python3 bench/agent_fleet.py --concurrent --out "$OUT/step_fleet" \
        --time-limit "${CONC_SECONDS:-20}" --configs ceiling,kvtier-unfused,kvtier-nodg,kvtier \
        --hibernate-configs kvtier-b96-p256 2>&1 | quiet >"$OUT/step_fleet.txt" ;;
    grammar)
      timeout $(limit 400) python3 bench/grammar_step.py --shape qwen2-7b --batch 64 >"$OUT/grammar.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "   rc=$? $(date +%T)"
done
