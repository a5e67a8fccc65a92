"""Counters of a TieredCache and the CacheSnapshot built from them (DESIGN.md section 7)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.snapshot import (
    RESTORE_BUCKETS,
    CacheSnapshot,
    RestoreHistogram,
    TierStats,
)
from kvtier.types import RestoreSource, SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.core import TieredCache


@dataclass
class Counters:
    """Totals since the cache started; read only through `build_snapshot`."""

    hits: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    decisions: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in RestoreSource})
    restored_tokens: dict[str, int] = field(
        default_factory=lambda: {s.value: 0 for s in RestoreSource}
    )
    latency: dict[str, list[int]] = field(
        default_factory=lambda: {s.value: [0] * len(RESTORE_BUCKETS) for s in RestoreSource}
    )
    latency_sum: dict[str, float] = field(
        default_factory=lambda: {s.value: 0.0 for s in RestoreSource}
    )
    latency_count: dict[str, int] = field(
        default_factory=lambda: {s.value: 0 for s in RestoreSource}
    )
    checksum_failures: int = 0
    oom_retries: int = 0
    l3_full: int = 0


def build_snapshot(cache: TieredCache) -> CacheSnapshot:
    """Assemble the snapshot; the caller holds the cache's lock."""
    C = cache.chunk_tokens
    l1_chunks = sum(-(-len(s.tokens) // C) for s in cache._sessions.values() if s.resident)
    l3 = cache.l3.stats()
    eng = cache.engine.stats()
    tiers = (
        TierStats(
            "l1",
            cache.l1.budget_bytes,
            cache.l1.used_bytes,
            l1_chunks,
            cache._n.hits["l1"],
            cache._n.misses["l1"],
            cache._n.evictions["l1"],
        ),
        TierStats(
            "l2",
            cache.l2.n_slots * cache.l2.slot_bytes,
            (cache.l2.n_slots - cache.l2.free_slots) * cache.l2.slot_bytes,
            cache.l2.n_slots - cache.l2.free_slots,
            cache._n.hits["l2"],
            cache._n.misses["l2"],
            cache._n.evictions["l2"],
        ),
        TierStats(
            "l3",
            l3.capacity_bytes,
            l3.used_bytes,
            l3.chunks,
            cache._n.hits["l3"],
            cache._n.misses["l3"],
            cache._n.evictions["l3"],
        ),
    )
    by_state: dict[str, int] = {st.value: 0 for st in SessionState if st.value != "closed"}
    for s in cache._sessions.values():
        by_state[s.state.value] = by_state.get(s.state.value, 0) + 1
    by_state["pinned"] = sum(1 for s in cache._sessions.values() if s.pinned)
    hist = tuple(
        RestoreHistogram(
            src=src,
            buckets=tuple(cache._n.latency[src]),
            count=cache._n.latency_count[src],
            sum_seconds=cache._n.latency_sum[src],
        )
        for src in cache._n.latency
    )
    return CacheSnapshot(
        taken_at=time.time(),
        tiers=tiers,
        sessions_by_state=tuple(sorted(by_state.items())),
        transfers=tuple(eng.transfers),
        queue_depths=(("l3_read", eng.l3_read_queue), ("l3_write", eng.l3_write_queue)),
        restore_decisions=tuple(sorted(cache._n.decisions.items())),
        restored_tokens=tuple(sorted(cache._n.restored_tokens.items())),
        restore_latency=hist,
        checksum_failures=cache._n.checksum_failures + l3.checksum_failures,
        shed_writes=eng.shed_writes,
        io_errors=l3.io_errors,
        oom_retries=cache._n.oom_retries,
        sessions=tuple(s.info() for s in cache._sessions.values()),
    )
