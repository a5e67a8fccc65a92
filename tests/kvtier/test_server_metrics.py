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


def test_a_collection_inside_a_scrape_of_the_family_does_not_deadlock() -> None:
    """A scrape copies the family's children under its lock, and the copy may start a
    collection in the scraping thread: the callback runs there, holding that lock."""
    import threading

    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    metrics.watch_gc()
    before = _count(registry, "0")

    def scrape_that_collects() -> None:
        with metrics.gc_pause_seconds._lock:
            gc.collect(0)

    try:
        t = threading.Thread(target=scrape_that_collects, daemon=True)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "the gc callback deadlocked on the family's lock"
    finally:
        metrics.watch_gc(False)
    assert _count(registry, "0") == before + 1
