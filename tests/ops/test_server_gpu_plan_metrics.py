"""`ServerMetrics.gpu_memory_plan`: the GPU memory plan on /metrics, each part, the budget and
the bytes held read at scrape time; absent without a plan; no family name shared with the
exporter's families on the same /metrics."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_inputs import (
    GIB,
    PlanStandIn,
    fixture_host_snapshot,
    full_cache_snapshot,
    h200_plan,
)

from kvtier.server.metrics import ServerMetrics
from ops.exporter import CacheCollector, HostCollector

ORDER = [
    "context",
    "weights",
    "activations",
    "graphs",
    "staging",
    "l1",
    "inflight",
    "pool",
    "headroom",
]


def samples(registry: CollectorRegistry, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(registry).decode()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    ]


def test_every_part_the_budget_and_the_bytes_held() -> None:
    registry = CollectorRegistry()
    plan = h200_plan(used=100 * GIB)
    ServerMetrics(registry).gpu_memory_plan(plan)
    got = samples(registry, "kvtier_gpu_memory_")
    parts = [(s[1]["part"], s[2]) for s in got if s[0] == "kvtier_gpu_memory_bytes"]
    assert [p for p, _ in parts] == ORDER  # plan order
    assert dict(parts) == {k: float(v) for k, v in plan.parts().items()}
    budget = registry.get_sample_value("kvtier_gpu_memory_budget_bytes")
    assert budget == plan.budget_bytes == int(141 * 1e9 * 0.9)
    assert sum(v for _, v in parts) == budget  # the parts fill the budget
    assert registry.get_sample_value("kvtier_gpu_memory_process_bytes") == 100 * GIB
    text = generate_latest(registry).decode()
    assert "# TYPE kvtier_gpu_memory_bytes gauge" in text
    assert "# TYPE kvtier_gpu_memory_budget_bytes gauge" in text
    assert 'kvtier_gpu_memory_bytes{part="headroom"} 5.36870912e+08' in text


def test_used_is_read_at_each_scrape() -> None:
    registry = CollectorRegistry()
    plan = h200_plan(used=50 * GIB)
    ServerMetrics(registry).gpu_memory_plan(plan)
    assert registry.get_sample_value("kvtier_gpu_memory_process_bytes") == 50 * GIB
    plan.used = 130 * GIB  # the allocator grew: no call in between
    assert registry.get_sample_value("kvtier_gpu_memory_process_bytes") == 130 * GIB


def test_a_newer_plan_replaces_the_figures() -> None:
    """The server publishes the plan at start and again with the measured figures."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    metrics.gpu_memory_plan(PlanStandIn({"weights": 100, "pool": 800, "headroom": 100}, 10))
    metrics.gpu_memory_plan(PlanStandIn({"weights": 100, "pool": 700, "staging": 300}, 20))
    got = samples(registry, "kvtier_gpu_memory_")
    parts = {s[1]["part"]: s[2] for s in got if s[0] == "kvtier_gpu_memory_bytes"}
    assert parts == {"weights": 100, "pool": 700, "staging": 300}  # headroom's series removed
    assert registry.get_sample_value("kvtier_gpu_memory_budget_bytes") == 1100
    assert registry.get_sample_value("kvtier_gpu_memory_process_bytes") == 20  # the new plan's


def test_without_a_plan_the_families_are_absent() -> None:
    """The CPU, or a model placed across devices: no series and no HELP, not a 0 budget."""
    registry = CollectorRegistry()
    ServerMetrics(registry)
    assert "gpu_memory" not in generate_latest(registry).decode()


def test_no_family_name_is_shared_with_the_exporter(tmp_path: Path) -> None:
    """kvtier serve serves the server's families and the exporter's on one /metrics (NVML has
    `kvtier_gpu_memory_used_bytes`): every family name must appear once."""
    host = fixture_host_snapshot()
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    metrics.gpu_memory_plan(h200_plan())
    registry.register(CacheCollector(full_cache_snapshot))
    registry.register(HostCollector(tmp_path, sample_fn=lambda previous: host))
    text = generate_latest(registry).decode()
    types = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert "kvtier_gpu_memory_used_bytes" in types  # the NVML family is there too
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
