"""The shared L4 tier (Redis) as Prometheus families: a pure function of the cache's L4 stats.

The cache reports its L4 client as `stats()["l4"]`: None (or no such key) when no L4 is
configured, else a mapping with `up`, `breaker` ("closed" | "half_open" | "open") and cumulative
counters (`bytes_written`, `bytes_read`, `hits`, `misses`, `errors`, `writes_shed`,
`get_seconds_sum`, `get_count`, `put_seconds_sum`, `put_count`). Without an L4 no `kvtier_l4_*`
family is produced at all: an absent series says "not configured", a zero would say "idle".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

# `kvtier_l4_breaker_state`: the circuit breaker as a number, so a rule can compare it.
BREAKER_STATES: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}
BREAKER_OPEN = BREAKER_STATES["open"]

# (name without _total, help, stats key): one counter each
_COUNTERS = (
    ("kvtier_l4_hits", "Chunks found in L4 and verified on read.", "hits"),
    ("kvtier_l4_misses", "Chunks looked up in L4 and not found (evicted or expired).", "misses"),
    (
        "kvtier_l4_errors",
        "L4 operations that failed (connection, timeout, corrupt value).",
        "errors",
    ),
    (
        "kvtier_l4_writes_shed",
        "Write-behind copies to L4 dropped because its queue was full or the breaker open.",
        "writes_shed",
    ),
)


def l4_stats(snap: Any) -> Mapping[str, Any] | None:
    """The L4 stats of a cache snapshot, or None when it has no L4.

    Read defensively: a snapshot that predates L4 (no `l4` attribute or key) has no L4; the
    stats may be a mapping or a dataclass."""
    value: Any = None
    if isinstance(snap, Mapping):
        value = snap.get("l4")
    else:
        value = getattr(snap, "l4", None)
        if value is None:
            try:
                value = snap["l4"]
            except (KeyError, TypeError, IndexError):
                value = None
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return value if isinstance(value, Mapping) else None


def _num(stats: Mapping[str, Any], key: str) -> float:
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def l4_families(stats: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Every `kvtier_l4_*` family for one reading of the L4 stats; nothing for None."""
    if stats is None:
        return
    yield GaugeMetricFamily(
        "kvtier_l4_up",
        "1 when the cache reports its L4 store (Redis) reachable, else 0.",
        value=1 if stats.get("up") else 0,
    )
    state = BREAKER_STATES.get(str(stats.get("breaker")))
    if state is not None:
        yield GaugeMetricFamily(
            "kvtier_l4_breaker_state",
            "The L4 circuit breaker: 0 closed, 1 half open (probing), 2 open (L4 bypassed).",
            value=state,
        )
    moved = CounterMetricFamily(
        "kvtier_l4_bytes", "Bytes moved to and from L4, by direction.", labels=["direction"]
    )
    moved.add_metric(["read"], _num(stats, "bytes_read"))
    moved.add_metric(["written"], _num(stats, "bytes_written"))
    yield moved
    for name, doc, key in _COUNTERS:
        yield CounterMetricFamily(name, doc, value=_num(stats, key))
    latency = SummaryMetricFamily(
        "kvtier_l4_operation_seconds",
        "Time of L4 operations, by operation (get, put).",
        labels=["op"],
    )
    for op in ("get", "put"):
        latency.add_metric(
            [op],
            count_value=int(_num(stats, f"{op}_count")),
            sum_value=_num(stats, f"{op}_seconds_sum"),
        )
    yield latency
    yield from _shard_families(stats.get("shards"))


def _shard_families(shards: Any) -> Iterator[Metric]:
    """Per shard of a Redis Cluster L4 (its primary's host:port): replicas attached, and the
    reads of this host that it answered. Nothing on one Redis server."""
    if not shards:
        return
    replicas = GaugeMetricFamily(
        "kvtier_l4_shard_replicas",
        "Replicas attached to each L4 cluster shard's primary (0: losing it loses its slots).",
        labels=["shard", "slots"],
    )
    hits = CounterMetricFamily(
        "kvtier_l4_shard_hits", "L4 chunk reads found, by cluster shard.", labels=["shard"]
    )
    misses = CounterMetricFamily(
        "kvtier_l4_shard_misses", "L4 chunk reads not found, by cluster shard.", labels=["shard"]
    )
    for s in shards:
        name = str(s.get("shard", ""))
        replicas.add_metric([name, str(s.get("slots", ""))], _num(s, "replicas"))
        hits.add_metric([name], _num(s, "hits"))
        misses.add_metric([name], _num(s, "misses"))
    yield from (replicas, hits, misses)
