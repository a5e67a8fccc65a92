"""The GPU memory plan's arithmetic (kvtier.server.devices.memplan) and `kvtier plan --gpu-memory-utilization`.

The CUDA side (the profile run, the budget enforced through the allocator, graphs measured) runs
in the GPU bench (bench/small_gpu.py); here: what the plan promises from its inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.plan import command as plan_command
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.server.config import DEFAULT_L1_BYTES, ServerConfig
from kvtier.server.devices.memplan import (
    PARTS,
    WARM_UP_L1_TOKENS,
    offline_plan,
    plan_memory,
    planned_config,
)

GiB = 2**30
MiB = 2**20
QWEN2_7B = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen2-7b" / "config.json"


def _plan(**over: object):
    args: dict[str, object] = dict(
        device="cuda:0",
        total_bytes=24 * GiB,
        utilization=0.9,
        weights=14 * GiB,
        activations=400 * MiB,
        graphs=500 * MiB,
        staging=224 * MiB,
        per_token=57344,
        context_tokens=32768,
    )
    args.update(over)
    return plan_memory(**args)  # type: ignore[arg-type]


def test_parts_fill_the_budget_and_the_pool_gets_what_is_left() -> None:
    plan = _plan()
    parts = plan.parts()
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == plan.budget_bytes == int(24 * GiB * 0.9)
    assert all(v >= 0 for v in parts.values())
    # L1 with paged L1 is the staging plus the warm-up's room, not a share of the device
    assert plan.l1_bytes == plan.staging + 57344 * WARM_UP_L1_TOKENS
    assert WARM_UP_L1_TOKENS % 256 == 0 and WARM_UP_L1_TOKENS >= 2048 + 32
    assert plan.inflight == plan.staging  # copies in flight: as much again as the staging
    fixed = sum(parts[p] for p in PARTS if p not in ("pool", "headroom"))
    assert plan.pool == plan.budget_bytes - fixed - plan.headroom
    assert 0 < plan.headroom <= 512 * MiB
    assert "budget 21.6 GiB" in plan.describe() and "pool" in plan.describe()


def test_overrides_are_checked_against_the_budget() -> None:
    roomy = _plan()
    given = _plan(pool_bytes=2 * GiB, l1_bytes=1 * GiB)
    assert given.pool == 2 * GiB and given.l1_bytes == 1 * GiB
    assert given.headroom > roomy.headroom  # what the pool did not take stays free
    with pytest.raises(ConfigError, match=r"batch_kv_bytes .* does not fit"):
        _plan(pool_bytes=8 * GiB)
    with pytest.raises(ConfigError, match="must exceed the transfer engine's staging"):
        _plan(l1_bytes=100 * MiB)


def test_a_budget_too_small_is_refused_with_what_fits() -> None:
    with pytest.raises(ConfigError) as info:
        _plan(context_tokens=131072)  # 7 GiB for one full-context session
    text = str(info.value)
    assert "less than one full-context session (7.0 GiB)" in text
    assert "raise --gpu-memory-utilization to at least 0.9" in text
    assert "--max-model-len" in text
    with pytest.raises(ConfigError, match="too small for it"):
        _plan(weights=30 * GiB)
    with pytest.raises(ConfigError, match="not in"):
        _plan(utilization=1.5)


def test_planned_config_takes_the_plan_where_nothing_was_given() -> None:
    plan = _plan()
    cfg = planned_config(ServerConfig(), plan)
    assert cfg.l1_bytes == plan.l1_bytes and cfg.batch_kv_bytes == plan.pool
    assert planned_config(ServerConfig(), None) == ServerConfig()


def test_automatic_settings_resolve_by_device() -> None:
    cfg = ServerConfig()
    assert cfg.max_concurrency == 0 and cfg.l1_bytes == 0
    cpu, gpu = cfg.for_device("cpu"), cfg.for_device("cuda")
    assert (cpu.max_concurrency, cpu.l1_bytes) == (8, DEFAULT_L1_BYTES)
    assert (gpu.max_concurrency, gpu.l1_bytes) == (64, 0)  # L1: the plan sizes it
    assert ServerConfig(max_concurrency=3).for_device("cuda").max_concurrency == 3
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        ServerConfig(gpu_memory_utilization=0)
    loaded = ServerConfig.load(env={"KVTIER_GPU_MEMORY_UTILIZATION": "0.5"})
    assert loaded.gpu_memory_utilization == 0.5


def test_offline_plan_of_a_7b_model_on_24_gb() -> None:
    config = json.loads(QWEN2_7B.read_text())
    g = KVGeometry.from_config(config)
    plan = offline_plan(config, g, 24 * GiB, 0.9, 64, 1024, 512, 256, context_tokens=32768)
    assert 15.0e9 < plan.weights < 15.5e9  # 7.6 B parameters in bf16
    assert plan.pool > 4 * GiB
    assert sum(plan.parts().values()) == plan.budget_bytes


def test_kvtier_plan_prints_the_gpu_plan_and_refuses_what_cannot_fit() -> None:
    runner = CliRunner()
    args = ["--model", str(QWEN2_7B), "--gpu-mem", "24GiB"]
    ok = runner.invoke(
        plan_command, [*args, "--gpu-memory-utilization", "0.9", "--max-model-len", "32768"]
    )
    assert ok.exit_code == 0, ok.output
    assert "GPU memory plan" in ok.output
    names = {"pool": "pool (L1)", "l1": "L1 buffers"}  # as kvtop and loadgen name them
    for part in PARTS:
        assert f"  {names.get(part, part)} " in ok.output
    assert "full-context sessions of 32,768" in ok.output
    small = runner.invoke(plan_command, [*args, "--gpu-memory-utilization", "0.5"])
    assert small.exit_code == 1
    assert "less than one full-context session" in small.output
