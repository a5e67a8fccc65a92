"""bench/gpu_long_prefill.py run on the CPU at a tiny shape before a GPU call spends its time
on it: both attention paths over each context, their results compared, the plan's term
printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_long_prefill.py")]
    cmd += ["--device", "cpu", "--shape", "qwen2-tiny", "--contexts", "40", "300", "--reps", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [40, 300]
    assert all(float(r[-1]) == 0.0 for r in rows)  # the same results, head groups or not
    assert done.stdout.rstrip().splitlines()[-1].startswith("PASS")
