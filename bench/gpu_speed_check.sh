#!/usr/bin/env bash
# Behaviour and speed unchanged by a restructuring: the GPU fleet's step P50 and tok/s of this
# tree against a base tree (an export of an earlier commit: `git archive REV kvtier bench`), on
# the same card in the same call, alternating base and this tree, base first in odd pairs and this
# tree first in even ones (bench/agent_fleet.py --concurrent, the fit scenario, the `kvtier`
# configuration).
#
#   BASE=path/to/base bash bench/gpu_speed_check.sh [OUT]     # about 3 minutes per pair
#   PAIRS=2 SECONDS_RUN=20 ...
set -uo pipefail
cd "$(dirname "$0")/.."
: "${BASE:?set BASE to the base tree (git archive REV kvtier bench | tar -x -C BASE)}"
OUT="${1:-${OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$(pwd)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
run() {  # run TREE LABEL
  (cd "$1" && PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout 240 python3 bench/agent_fleet.py \
    --concurrent --configs kvtier --hibernate-sessions 0 --time-limit "${SECONDS_RUN:-20}" \
    --out "$OUT/$2" >"$OUT/$2.txt" 2>&1)
  echo "exit $?" >>"$OUT/$2.txt"
}
for i in $(seq "${PAIRS:-1}"); do  # the order alternates: a first run's place weighs on neither
  if (( i % 2 )); then
    run "$BASE" "base-$i"; run "$here" "new-$i"
  else
    run "$here" "new-$i"; run "$BASE" "base-$i"
  fi
done
python3 - "$OUT" <<'PY'
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
row = re.compile(r"^\s+kvtier\s+([\d,.]+)\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")
dec = re.compile(r"kvtier: (\d+) decode-only steps \(P50 ([\d.]+) ms\)")
phase = re.compile(r"server TTFT P50 by phase \(ms\): .*?restore ([\d.]+),")
# device bytes beyond the weights against the budget, and where returning turns came from
mem = re.compile(r"device beyond the weights: steady ([\d.]+) GiB .*?peak ([\d.]+) GiB .*?budget "
                 r"([\d.]+) GiB; \d+ returning turns from ([^;]+)")
print(f"{'run':<8} {'tok/s':>8} {'TTFT P50':>9} {'restore P50':>12} {'step P50':>9} {'step P99':>9} "
      f"{'decode-only P50':>16}  (ms)   device GiB steady / peak / budget   restored from")
for f in sorted(out.glob("*-[0-9]*.txt")):
    text = f.read_text()
    rows = [row.match(line) for line in text.splitlines()]
    rows = [r for r in rows if r]
    d = dec.search(text)
    ph = phase.search(text)
    m = mem.search(text)
    dev = f"{m[1]} / {m[2]} / {m[3]}   {m[4]}" if m else "-"
    if m and not re.search(r"(l2|l3|l4) [1-9]", m[4]):
        dev += "  (nothing left the GPU)"
    if not rows:
        print(f"{f.stem:<8} no kvtier row: {text[-300:]!r}")
        continue
    r = rows[-1]
    print(f"{f.stem:<8} {r[1]:>8} {r[2]:>9} {ph[1] if ph else '-':>12} {r[4]:>9} {r[5]:>9} {d[2] if d else '-':>16}        {dev}")
print("(the budget: the L1 budget, page pool with the cache's L1 buffers and staging; the step's "
      "activations and graphs come on top of it, inside the memory plan)")
PY
