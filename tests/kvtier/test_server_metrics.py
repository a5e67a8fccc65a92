"""The server's garbage-collection pause histogram: every collection while watched, none after."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from kvtier.server.metrics import ServerMetrics


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value(
        "kvtier_server_gc_pause_seconds_count", {"generation": generation}
    )
    return value or 0.0


def test_collections_are_timed_by_generation_while_watched() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    metrics.watch_gc()
    try:
        gc.collect(1)
        gc.collect(2)
        assert _count(registry, "1") >= 1 and _count(registry, "2") >= 1
        total = registry.get_sample_value("kvtier_server_gc_pause_seconds_sum", {"generation": "2"})
        assert total is not None and 0 < total < 5
        metrics.watch_gc()  # twice: still one callback
        assert gc.callbacks.count(metrics._on_gc) == 1
    finally:
        metrics.watch_gc(False)
    before = _count(registry, "2")
    gc.collect(2)
    assert _count(registry, "2") == before and metrics._on_gc not in gc.callbacks
