"""The CPU smoke run of `bench/agent_fleet.py --concurrent` (the batched-serving benchmark): every
configuration of both scenarios runs on a tiny Qwen2 and the report, JSON and plot come out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_concurrent_fleet_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "agent_fleet.py"),
        "--concurrent",
        "--shape", "qwen2-mini",
        "--device", "cpu",
        "--sessions", "4",
        "--context", "128",
        "--system", "64",
        "--decode-tokens", "4",
        "--max-growth", "512",
        "--hibernate-sessions", "8",
        "--l1-sessions", "2",
        "--think-hibernate", "0.05,0.1",
        "--seq-hibernate",
        "--hibernate-configs", "ceiling,kvtier-seq,kvtier,kvtier-int8,kvtier-b4-p8",
        "--time-limit", "3",
        "--warmup", "0.5",
        "--gpu-memory-gb", "24",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "targets:" in proc.stdout
    assert "GPU memory cap of 24 GiB ignored: the device is cpu" in proc.stdout
    assert "seeding" in proc.stdout  # where each configuration's time went besides its window
    data = json.loads((out / "fleet_concurrent.json").read_text())
    assert (out / "fleet_concurrent.png").stat().st_size > 0
    assert set(data["results"]) == {"fit", "hibernate"}
    fit = {r["config"]: r for r in data["results"]["fit"]}
    assert {"ceiling", "generate_batch", "kvtier-seq", "kvtier", "kvtier-int8"} <= set(fit)
    for name in ("ceiling", "kvtier-seq", "kvtier", "kvtier-int8"):
        row = fit[name]
        assert not row["note"].startswith("failed"), row
        assert row["tokens"] > 0 and row["tok_s"] > 0, row
        assert row["failed"] == 0, row
    for name in ("kvtier", "kvtier-int8"):  # the batched rows: steps and returning turns seen
        assert fit[name]["step_p50"] > 0 and fit[name]["returning_turns"] > 0, fit[name]
        assert fit[name]["ttft_p50"] > 0, fit[name]
        phases = fit[name]["extra_ttft_phases_p50_ms"]  # where the server's TTFT went
        names = {"slot", "queued", "restore", "of which L1 room", "waiting", "copy-in", "steps"}
        assert names | {"total"} == set(phases)
        assert phases["restore"] >= phases["of which L1 room"] >= 0, phases
        assert phases["total"] >= phases["steps"] > 0, phases
        assert sum(fit[name]["extra_restore_sources"].values()) > 0, fit[name]
        assert fit[name]["extra_gpu_gaps"] == {}  # the GPU's idle between steps: CUDA only
        tail = fit[name]["extra_step_tail"]  # what the slowest steps had in common
        steps = fit[name]["extra_decode_only_steps"] + fit[name]["extra_mixed_steps"]
        if steps < 20:  # a loaded machine may fit fewer steps in the window: none drawn
            assert tail == {}, (steps, tail)
        else:
            assert tail["tail"]["mean_ms"] >= tail["body"]["mean_ms"] > 0, tail
        assert tail["tail"]["steps"] > 0 and tail["body"]["steps"] > 0, tail
        admits = tail["tail"]["admissions"] * tail["tail"]["steps"]
        admits += tail["body"]["admissions"] * tail["body"]["steps"]
        assert admits > 0, tail  # the scheduler admitted turns inside the window
        for group in ("tail", "body"):  # the scheduler thread's launch and wait, per interval
            assert tail[group]["launch_ms"] > 0 and tail[group]["wait_ms"] >= 0, tail
        stored = fit[name]["extra_stored"]  # what the window's commits stored
        assert stored["chunks_per_s"] >= stored["tails_per_s"] > 0, stored
        assert 0 < stored["tail_token_share"] <= 1, stored
    hib = {r["config"]: r for r in data["results"]["hibernate"]}
    assert {"ceiling", "kvtier-seq", "kvtier", "kvtier-int8", "kvtier-b4-p8"} <= set(hib)
    assert "kvtier-b4-p8" not in fit  # a hibernate-only configuration
    for name in ("kvtier", "kvtier-int8", "kvtier-b4-p8"):
        assert not hib[name]["note"].startswith("failed"), hib[name]
        assert hib[name]["tokens"] > 0, hib[name]
    assert any(c["target"].startswith("kvtier-b4-p8:") for c in data["targets"]["hibernate"])
    # the L1 budget sized once: a paged configuration's page pool and cache L1 together are the
    # budget (2 contexts of the longest, 128 + 512 + 256 + 4 tokens, 4,096 bytes a token)
    budget = 2 * (128 + 512 + 256 + 4) * 4096
    assert hib["kvtier"]["extra_device_budget_bytes"] == budget, hib["kvtier"]
    assert hib["kvtier-int8"]["extra_device_budget_bytes"] == 2 * budget  # the pool beside L1
    for name in ("kvtier-seq", "kvtier", "kvtier-int8", "kvtier-b4-p8"):
        row = hib[name]  # device bytes n/a on the CPU; the returning turns' sources counted
        assert row["extra_device_steady_bytes"] is None, row
        assert row["extra_device_peak_bytes"] is None, row
        sources = row["extra_returning_sources"]
        assert {"l1", "l2", "l3", "recompute"} <= set(sources), sources
        assert sum(sources.values()) == row["returning_turns"], row
    assert hib["kvtier"]["extra_resident_sessions"] >= 0
    assert "device beyond the weights: steady n/a" in proc.stdout
    assert "HIBERNATED: " in proc.stdout
    assert any(c["target"].startswith("kvtier: hibernated") for c in data["targets"]["hibernate"])
    states = {c["state"] for scen in data["targets"].values() for c in scen}
    assert states <= {"met", "missed", "n/a"} and states
