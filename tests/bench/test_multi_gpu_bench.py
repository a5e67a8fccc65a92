"""The CPU smoke run of `bench/multi_gpu.py`: two logical CPU devices, every phase (replicas:
the fleet on 1 device vs 2 replicas and replica 0 lost mid-turn; layers across devices:
transfer, decode 1 vs 2 devices, failover mid-turn and restore) runs and reports no lost
session and equal tokens."""

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
    # the replicas section: twice the sessions on two replicas, replica 0 lost mid-turn
    assert "fleet tok/s (generated / wall)" in proc.stdout
    rt, rf = res["replicas"]["throughput"], res["replicas"]["failover"]
    assert rt["tok_s_1"] > 0 and rt["tok_s_2"] > 0 and rt["oom"] == rt["failed"] == 0
    assert rt["equal"] == rt["sessions_2"] and min(rt["per_replica_sessions"]) > 0
    assert rf["lost_replicas"] == [0] and rf["on_lost_replica"] > 0
    assert rf["sessions_lost"] == 0 and rf["fault_to_token_s"] < 5
    assert rf["resumed_equal"] == rf["next_turn_equal"] == rf["sessions"]
    assert rf["restored_from_tiers"] == rf["sessions"]
