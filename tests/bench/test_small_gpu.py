"""bench/small_gpu.py (the seed's A10 table) and the honest-memory figures of the fleet bench:
the CPU smoke run of every code path, and the pieces that decide a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fleet_concurrent import split_l1
from fleet_report import hibernated, memory_text
from fleet_serve import MemorySampler, cap_gpu_memory, count_sources

ROOT = Path(__file__).resolve().parents[2]


def test_paged_l1_budget_is_split_once() -> None:
    """The page pool and the cache's L1 together are the stated L1 budget."""
    session = 4344 * 57344  # the H200 fleet's longest context, Qwen2-7B bf16
    budget = 64 * session
    l1, pool = split_l1(budget, session)
    assert l1 + pool == budget
    assert l1 == 2 * session
    l1, pool = split_l1(2 * session, session)  # a budget of two: one each
    assert (l1, pool) == (session, session)


def test_hibernated_verdict() -> None:
    row = {
        "extra_returning_sources": {"l1": 10, "l2": 60, "l3": 30, "recompute": 0},
        "extra_sessions_kv_bytes": 30 << 30,
        "extra_home_bytes": 15 << 30,
    }
    assert hibernated(row) == (True, 90, 100)
    row["extra_returning_sources"] = {"l1": 100, "l2": 0, "l3": 0, "recompute": 0}
    assert hibernated(row) == (False, 0, 100)  # the H200 run's: all from l1
    row["extra_sessions_kv_bytes"] = 10 << 30  # it all fits the pool: nothing had to go
    assert hibernated(row)[0] is None


def test_memory_text_cpu_and_gpu() -> None:
    cpu = {
        "extra_device_steady_bytes": None,
        "extra_device_peak_bytes": None,
        "extra_device_budget_bytes": 1 << 30,
        "extra_returning_sources": count_sources(["l1", "l2", "l2"]),
        "extra_resident_sessions": 3,
    }
    text = memory_text(cpu)
    assert "steady n/a" in text and "peak n/a" in text
    assert "3 returning turns from l1 1, l2 2, l3 0, recompute 0" in text
    assert "3 sessions in the pool" in text
    gpu = dict(cpu, extra_device_steady_bytes=31 << 30, extra_device_peak_bytes=32 << 30)
    gpu["extra_device_budget_bytes"] = 15 << 30
    assert "steady 31.00 GiB (2.07x the budget)" in memory_text(gpu)


def test_gpu_cap_off_cuda_is_a_note() -> None:
    assert "ignored" in cap_gpu_memory(24, "cpu")
    sampler = MemorySampler("cpu").start()
    sampler.stop()
    assert sampler.median(None) is None  # no samples off CUDA


@pytest.mark.slow
def test_small_gpu_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "small_gpu.py"),
        "--device", "cpu",
        "--shape", "qwen2-mini",
        "--caps", "24,0",
        "--sessions", "4,8",
        "--batches", "2,4",
        "--first", "4",
        "--oom-above", "2",  # batch 4 runs out of memory: the search goes down to 2
        "--context", "128",
        "--system", "64",
        "--decode-tokens", "4",
        "--max-growth", "256",
        "--time-limit", "2",
        "--warmup", "0.5",
        "--search-time", "2",
        "--search-warmup", "0",
        "--slots", "4",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    head = ("config |", "sessions |", "decoding at once |", "OOM |", "peak GiB / cap |", "tok/s")
    assert all(h in text for h in head) and "TTFT P50 / P99 ms" in text
    assert "ignored" in text  # the caps off CUDA
    assert "KV memory saved against all-on-GPU" in text and "targets:" in text
    assert "GPU memory plan on cpu" in text
    assert (out / "small_gpu.png").stat().st_size > 0
    data = json.loads((out / "small_gpu.json").read_text())
    assert [c["cap_gib"] for c in data["caps"]] == [24.0, 0.0]
    for cap in data["caps"]:
        rows = {r["config"]: r for r in cap["rows"]}
        assert set(rows) == {"all-GPU B=2", "all-GPU B=4", "kvtier 4", "kvtier 8 think"}
        assert rows["all-GPU B=4"]["oom"] == 1 and "OOM" in rows["all-GPU B=4"]["note"]
        fit = rows["all-GPU B=2"]
        assert fit["oom"] == 0 and fit["tok_s"] > 0 and fit["ttft_p50"] > 0, fit
        for name in ("kvtier 4", "kvtier 8 think"):
            r = rows[name]
            assert r["oom"] == 0 and r["failed"] == 0, r
            assert r["tok_s"] > 0 and r["ttft_p50"] > 0 and r["decoding"] > 0, r
            assert r["pool_bytes"] == r["plan"]["pool"] > 0, r
            assert set(r["plan"]) >= {"weights", "activations", "staging", "l1", "pool"}, r
            assert r["peak_bytes"] is None and r["extra_device_steady_bytes"] is None  # CPU
            assert sum(r["extra_returning_sources"].values()) == r["returning_turns"], r
            assert r["extra_resident_sessions"] >= 0 and r["elapsed_s"] > 0, r
        lo, hi = rows["kvtier 8 think"]["think_s"]  # derived from the 4 sessions' step
        assert lo > 0 and hi == pytest.approx(lo * 1.25 / 0.75)
        targets = {c["target"]: c["state"] for c in cap["targets"]}
        assert targets["kvtier: 0 OOM at 8 sessions, peak under the cap"] == "met"
        assert targets["kvtier at 0 OOM serves >= 2x the sessions all-on-GPU can"] == "met"
        assert set(targets.values()) <= {"met", "missed", "n/a"}
        assert [s["sessions"] for s in cap["kv_saved"]] == [4, 8]
