"""The CPU smoke run of `bench/multi_gpu.py`: two logical CPU devices, every phase (transfer,
decode 1 vs 2 devices, failover mid-turn and restore) runs and reports no lost session and
equal tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multi_gpu_bench_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "multi_gpu.json"
    cmd = [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--device", "cpu", "--quick"]
    cmd += ["--reps", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault -> first token served again" in proc.stdout
    res = json.loads(out.read_text())
    fo = res["fo"]
    assert fo["sessions_lost"] == 0
    assert fo["resumed_equal"] == fo["next_turn_equal"] == fo["sessions"]
    assert fo["history"] == ["healthy", "draining", "degraded", "restoring", "healthy"]
    assert res["decode_equal"] == res["fleet"]["sessions"]
    assert res["xfer2"]["offload_gbps"] > 0 and res["dec2"]["decode_tok_s"] > 0
