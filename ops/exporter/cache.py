"""Cache-side collector: one `CacheSnapshot` in, fresh Prometheus metric families out.

The snapshot function is called once per scrape and nothing is kept between scrapes, so two
Prometheus servers scraping the same process see the same numbers (client_python's
gc_collector pattern). Metric names and labels follow
docs/architecture.md ("Observability") and docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.snapshot import RESTORE_BUCKETS, CacheSnapshot
from kvtier.types import RestoreSource, SessionState
from ops.exporter.l4 import l4_families, l4_stats

SnapshotFn = Callable[[], CacheSnapshot]

# Label values that always appear (as 0 when the snapshot omits them), so that a panel or rule
# on e.g. `kvtier_sessions{state="hibernated"}` has a series from the first scrape.
_STATES = tuple(s.value for s in SessionState if s is not SessionState.CLOSED)
# `l4` only with a shared tier (an L4 configured): a server without one has no l4 series at all.
_SOURCES = tuple(s.value for s in RestoreSource if s.value != "l4")
_SOURCES_L4 = (*(s for s in _SOURCES if s != "recompute"), "l4", "recompute")


class CacheCollector(Collector):
    """Exports a `CacheSnapshot` (from `TieredCache.stats()` or a read-only L3 view)."""

    def __init__(self, snapshot_fn: SnapshotFn) -> None:
        self._snapshot_fn = snapshot_fn

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot_fn())

    def describe(self) -> Iterator[Metric]:
        # Registering must not take a snapshot (the cache may not be built yet), so the
        # registry learns no names from us; duplicates are impossible inside one family set.
        return iter(())


# (family class, name, help, TierStats field): one sample per tier
_TIER_FAMILIES = (
    (GaugeMetricFamily, "kvtier_tier_capacity_bytes", "Byte budget of the tier.", "capacity_bytes"),
    (GaugeMetricFamily, "kvtier_tier_used_bytes", "Bytes of KV held in the tier.", "used_bytes"),
    (GaugeMetricFamily, "kvtier_tier_chunks", "Chunks held in the tier.", "chunks"),
    (CounterMetricFamily, "kvtier_tier_hits", "Chunks served from the tier on restore.", "hits"),
    (
        CounterMetricFamily,
        "kvtier_tier_misses",
        "Chunks looked up in the tier and not found.",
        "misses",
    ),
    (CounterMetricFamily, "kvtier_tier_evictions", "Chunks evicted from the tier.", "evictions"),
)
# (counter name, help, TransferStats field): one sample per (src, dst)
_TRANSFER_FAMILIES = (
    ("kvtier_transfer_bytes", "Bytes copied between tiers.", "bytes"),
    ("kvtier_transfer_seconds", "Seconds spent copying between tiers.", "seconds"),
    ("kvtier_transfer_operations", "Copies between tiers.", "ops"),
)


L3_UP_HELP = "1 when the cache's L3 store is open and was read for this scrape, else 0."


def l3_up(up: bool) -> Metric:
    """`kvtier_l3_up`: whether this scrape read the L3 store (0 before the cache ever ran)."""
    return GaugeMetricFamily("kvtier_l3_up", L3_UP_HELP, value=1 if up else 0)


def families(snap: CacheSnapshot) -> Iterator[Metric]:
    """Every cache family for one snapshot; always the same names, even for an idle cache."""
    yield l3_up(snap.tier("l3") is not None)
    for cls, name, doc, field in _TIER_FAMILIES:
        family = cls(name, doc, labels=["tier"])
        for t in snap.tiers:
            family.add_metric([t.tier], getattr(t, field))
        yield family

    sessions = GaugeMetricFamily(
        "kvtier_sessions", "Sessions by state (active, idle, hibernated).", labels=["state"]
    )
    for state, count in _with_zeros(snap.sessions_by_state, _STATES):
        sessions.add_metric([state], count)
    yield sessions

    for name, doc, field in _TRANSFER_FAMILIES:
        counter = CounterMetricFamily(name, doc, labels=["src", "dst"])
        for x in snap.transfers:
            counter.add_metric([x.src, x.dst], getattr(x, field))
        yield counter

    queues = GaugeMetricFamily(
        "kvtier_queue_depth", "Jobs waiting in a transfer queue.", labels=["queue"]
    )
    for name, depth in snap.queue_depths:
        queues.add_metric([name], depth)
    yield queues

    decisions = CounterMetricFamily(
        "kvtier_restore_decisions",
        "Restores by chosen source (a tier, or recompute when loading would be slower).",
        labels=["src"],
    )
    sources = _SOURCES if l4_stats(snap) is None else _SOURCES_L4
    for src, count in _with_zeros(_no_idle_l4(snap, snap.restore_decisions), sources):
        decisions.add_metric([src], count)
    yield decisions

    tokens = CounterMetricFamily(
        "kvtier_restored_tokens", "Tokens restored, by source.", labels=["src"]
    )
    for src, count in _with_zeros(_no_idle_l4(snap, snap.restored_tokens), sources):
        tokens.add_metric([src], count)
    yield tokens

    latency = HistogramMetricFamily(
        "kvtier_restore_duration_seconds",
        "Time to restore a session's KV, by source.",
        labels=["src"],
    )
    for h in snap.restore_latency:
        buckets = [(_le(b), float(n)) for b, n in zip(RESTORE_BUCKETS, h.buckets, strict=True)]
        buckets.append(("+Inf", float(h.count)))
        latency.add_metric([h.src], buckets, h.sum_seconds)
    yield latency

    for name, value, doc in (
        ("kvtier_checksum_failures", snap.checksum_failures, "Chunks whose checksum failed."),
        ("kvtier_shed_writes", snap.shed_writes, "Write-through copies dropped by a full queue."),
        ("kvtier_io_errors", snap.io_errors, "I/O errors returned by the L3 device."),
        ("kvtier_oom_retries", snap.oom_retries, "GPU allocations retried after an OOM."),
        (
            "kvtier_moved_sessions",
            snap.moved_sessions,
            "Sessions opened from their L4 record that another host served last (moved here).",
        ),
        (
            "kvtier_backpressure_waits",
            snap.backpressure_waits,
            "Times a commit or an eviction waited for copies to finish (L2 room, copies in "
            "flight on the device).",
        ),
        (
            "kvtier_backpressure_wait_seconds",
            snap.backpressure_wait_seconds,
            "Seconds commits and evictions waited for copies to finish.",
        ),
        (
            "kvtier_backpressure_drops",
            snap.backpressure_drops,
            "Stored prefixes cut where waiting made no room (their tokens are recomputed).",
        ),
    ):
        yield CounterMetricFamily(name, doc, value=value)

    yield from l4_families(l4_stats(snap))  # nothing without an L4

    yield GaugeMetricFamily(
        "kvtier_snapshot_timestamp_seconds",
        "Unix time the cache snapshot was taken.",
        value=snap.taken_at,
    )


def _with_zeros(
    pairs: tuple[tuple[str, int], ...], always: tuple[str, ...]
) -> list[tuple[str, int]]:
    """`pairs` plus a 0 for each label value in `always` that it lacks, in a stable order."""
    given = dict(pairs)
    return [(k, given.get(k, 0)) for k in always] + [(k, v) for k, v in pairs if k not in always]


def _no_idle_l4(
    snap: CacheSnapshot, pairs: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int], ...]:
    """`pairs` without a zero `l4` entry when the snapshot has no L4 (a cache always counts
    every source, but without an L4 its l4 series would only say "not configured" as 0)."""
    if l4_stats(snap) is not None:
        return pairs
    return tuple((k, v) for k, v in pairs if k != "l4" or v)


def _le(bound: float) -> str:
    """Bucket bound as Prometheus prints it (`0.005`, `1.0`, `+Inf`)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))
