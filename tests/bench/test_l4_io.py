"""The smoke run of `bench/l4_io.py`: it starts its own redis-server, fills the table and
stops the server again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_l4_io_smoke() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap.sh dev installs it)")
    cmd = [sys.executable, str(ROOT / "bench" / "l4_io.py"), "--chunks", "2", "--rounds", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for figure in ("put, 1 connection", "verified get, 1 connection", "a restore"):
        assert figure in proc.stdout


def test_l4_io_cluster_smoke() -> None:
    """`--cluster`: the same figures on a Redis Cluster of 3 masters and 3 replicas the bench
    starts and stops itself, kvtier through a redis+cluster:// L4Store."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap.sh dev installs it)")
    cmd = [sys.executable, str(ROOT / "bench" / "l4_io.py"), "--chunks", "2", "--rounds", "1",
           "--cluster"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a Redis Cluster (3 masters, 3 replicas)" in proc.stdout
    for figure in ("put, 1 connection", "verified get, 1 connection", "a restore"):
        assert figure in proc.stdout
