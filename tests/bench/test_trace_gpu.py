"""bench/trace_gpu.py (bench/gpu_trace.sh's driver) run on the CPU before a GPU call spends its
time on it: the two baselines on a small trace, each run's replay JSON and plot, and the
script's own checks that the baselines keep nothing below the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "kvtier"))

from trace_slice import write_trace  # noqa: E402


@pytest.mark.slow
def test_cpu_smoke_run_of_the_baselines(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", conversations=3, turns=2)
    cmd = [sys.executable, str(ROOT / "bench" / "trace_gpu.py"), "--trace", str(trace)]
    cmd += ["--device", "cpu", "--shape", "qwen2-tiny", "--sizes", "whole", "--sample", "1"]
    cmd += ["--configs", "gpu-only,no-cache", "--max-model-len", "4096", "--max-output", "4"]
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["config"]: r for r in json.loads((tmp_path / "out" / "trace_gpu.json").read_text())}
    pool, none = rows["gpu-only"], rows["no-cache"]
    assert pool["turns"] == none["turns"] == 6 and pool["failed_turns"] == none["failed_turns"] == 0
    assert pool["restore_mix"].get("l1", 0) > 0 and pool["l3_files"] == 0  # parked pages alone
    assert set(pool["restore_mix"]) <= {"l1", "recompute"} and pool["hit_ratio"]["achieved"] > 0
    assert none["restore_mix"] == {"recompute": 6} and none["hit_ratio"]["achieved"] == 0
    assert "whole gpu-only: no restore or file below the pool: PASS" in done.stdout
    assert "whole no-cache: every prompt recomputed: PASS" in done.stdout
    for name in rows:
        run = tmp_path / "out" / f"whole-{name}"
        assert json.loads((run / "replay.json").read_text())["replay"]["turns"] == 6
        assert (run / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
