#!/usr/bin/env bash
# The GPU runs of the hostile-input and agent-API work, for a machine with a CUDA GPU. Each
# step has its own time limit and writes its output under OUT (default ./gpu-out); STEPS=
# picks steps.
#
#   bash bench/gpu_agent.sh [OUT]                 # every step: about 15 minutes
#   STEPS="grammar" bash bench/gpu_agent.sh       # the grammar's cost in the batch alone
#
# Steps:
#   tests    the agent API, structured output, batching and server tests on the GPU (the
#            built-in model on CUDA: the grammar masks on device logits)
#   grammar  bench/grammar_step.py: 64 sessions of the Qwen2-7B shape with and without one
#            constrained row
#   fleet    bench/agent_fleet.py --concurrent: the 256-session hibernate scenario with L1 for 64
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-tests grammar fleet}"

for step in $STEPS; do
  echo "== $step $(date +%T)"
  case "$step" in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -x \
        tests/kvtier/test_server_agent_api.py tests/kvtier/test_structured_output.py \
        tests/kvtier/test_batching.py tests/kvtier/test_server.py \
        tests/kvtier/test_server_sessions.py tests/kvtier/test_batching_paged_l1.py \
        2>&1 | tail -30 >"$OUT/gpu_tests_agent.txt" ;;
    grammar)
      timeout 400 python3 bench/grammar_step.py --shape qwen2-7b --batch 64 >"$OUT/grammar.txt" 2>&1 ;;
    fleet)
      timeout 500 python3 bench/agent_fleet.py --concurrent --sessions 64 --hibernate-sessions 256 \
        --l1-sessions 64 --l2-factor 3.5 --time-limit 7 --think-hibernate 2.34,3.90 \
        --configs kvtier --hibernate-configs kvtier-b96-p256 >"$OUT/fleet.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "   rc=$? $(date +%T)"
done
