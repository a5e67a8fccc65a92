"""Counters of a TieredCache and the CacheSnapshot built from them.

The cache copies its numbers into `SnapshotInputs` under its lock; `build_snapshot` assembles
the snapshot from those and from the store's and the engine's own stats, taken outside the
lock (the store's come from its SQLite index). Nothing here reads the cache itself.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.snapshot import (
    RESTORE_BUCKETS,
    CacheSnapshot,
    RestoreHistogram,
    SessionInfo,
    TierStats,
)
from kvtier.types import RestoreSource, SessionState, Tier


@dataclass
class Counters:
    """Totals since the cache started; read through `build_snapshot`, or `copy()` (a bench
    that counts what a window stored)."""

    hits: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in Tier})
    misses: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in Tier})
    evictions: dict[str, int] = field(
        default_factory=lambda: {t.value: 0 for t in (Tier.L1, Tier.L2, Tier.L3)}
    )
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
    # chunks stored (offloaded to L2, queued for L3) and their tokens; "tails": partial tail
    # chunks among them (a hibernation's, or every commit of a turn from a batch's pages)
    stored: dict[str, int] = field(
        default_factory=lambda: {"chunks": 0, "tokens": 0, "tails": 0, "tail_tokens": 0}
    )
    checksum_failures: int = 0
    oom_retries: int = 0
    l3_full: int = 0
    record_errors: int = 0  # session record saves/deletes that failed (counted off the lock)
    # sessions this host did not hold, or held and saw resumed elsewhere since, opened from
    # their L4 record (another host served them: HAProxy moved them here); under the guard
    moved_sessions: int = 0
    # Backpressure (docs/metrics.md): waits of a commit or an eviction for copies to finish
    # (L3 writes freeing L2 room, device copies freeing in-flight room) and their seconds;
    # drops: stored prefixes cut where even waiting made no room (recomputed from there).
    # Counted under `guard`.
    backpressure_waits: int = 0
    backpressure_wait_seconds: float = 0.0
    backpressure_drops: int = 0
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_tier(self, name: str) -> None:
        """Count a cold tier registered after start (`ColdTiers.register`): its hits and
        misses, and the restores it is the source of."""
        for counts in (self.hits, self.misses, self.decisions, self.restored_tokens):
            counts.setdefault(name, 0)
        self.latency.setdefault(name, [0] * len(RESTORE_BUCKETS))
        self.latency_sum.setdefault(name, 0.0)
        self.latency_count.setdefault(name, 0)

    def count_wait(self, seconds: float) -> None:
        """One backpressure wait of `seconds` (any thread, with or without the cache's lock)."""
        with self.guard:
            self.backpressure_waits += 1
            self.backpressure_wait_seconds += seconds

    def count_drop(self) -> None:
        """A stored prefix cut because waiting made no room (its tokens are recomputed)."""
        with self.guard:
            self.backpressure_drops += 1

    def copy(self) -> Counters:
        with self.guard:
            return Counters(
                **{
                    k: copy.deepcopy(getattr(self, k))
                    for k in self.__dataclass_fields__
                    if k != "guard"
                }
            )


@dataclass(frozen=True)
class SnapshotInputs:
    """The cache's own numbers, copied under its lock."""

    counters: Counters
    l1_budget: int
    l1_used: int
    l1_chunks: int
    l2_slots: int
    l2_free: int
    l2_slot_bytes: int
    sessions: tuple[SessionInfo, ...]
    l4_chunks: int = 0  # chunks the shared tier is believed to hold


def build_snapshot(
    inp: SnapshotInputs, l3: Any, eng: Any, l4: dict[str, Any] | None = None
) -> CacheSnapshot:
    """Assemble the snapshot from copied numbers and the store's/engine's stats."""
    n = inp.counters
    l2_used = inp.l2_slots - inp.l2_free
    tiers: tuple[TierStats, ...] = (
        TierStats(
            Tier.L1.value,
            inp.l1_budget,
            inp.l1_used,
            inp.l1_chunks,
            n.hits[Tier.L1],
            n.misses[Tier.L1],
            n.evictions[Tier.L1],
        ),
        TierStats(
            Tier.L2.value,
            inp.l2_slots * inp.l2_slot_bytes,
            l2_used * inp.l2_slot_bytes,
            l2_used,
            n.hits[Tier.L2],
            n.misses[Tier.L2],
            n.evictions[Tier.L2],
        ),
        TierStats(
            Tier.L3.value,
            l3.capacity_bytes,
            l3.used_bytes,
            l3.chunks,
            n.hits[Tier.L3],
            n.misses[Tier.L3],
            l3.evictions,  # the store counts what its size cap and gc delete
        ),
    )
    if l4 is not None:  # a shared tier: its memory as Redis last reported it
        mem = l4.get("memory") or {}
        tiers += (
            TierStats(
                Tier.L4.value,
                int(mem.get("maxmemory") or 0),
                int(mem.get("used_memory") or 0),
                inp.l4_chunks,
                n.hits[Tier.L4],
                n.misses[Tier.L4],
                0,
            ),
        )
        l4 = {k: v for k, v in l4.items() if k != "memory"}
    by_state: dict[str, int] = {st.value: 0 for st in SessionState if st.value != "closed"}
    for s in inp.sessions:
        by_state[s.state] = by_state.get(s.state, 0) + 1
    by_state["pinned"] = sum(1 for s in inp.sessions if s.pinned)
    hist = tuple(
        RestoreHistogram(
            src=src,
            buckets=tuple(n.latency[src]),
            count=n.latency_count[src],
            sum_seconds=n.latency_sum[src],
        )
        for src in n.latency
    )
    return CacheSnapshot(
        taken_at=time.time(),
        tiers=tiers,
        sessions_by_state=tuple(sorted(by_state.items())),
        transfers=tuple(eng.transfers),
        queue_depths=(("l3_read", eng.l3_read_queue), ("l3_write", eng.l3_write_queue)),
        restore_decisions=tuple(sorted(n.decisions.items())),
        restored_tokens=tuple(sorted(n.restored_tokens.items())),
        restore_latency=hist,
        checksum_failures=n.checksum_failures + l3.checksum_failures,
        shed_writes=eng.shed_writes,
        io_errors=l3.io_errors,
        oom_retries=n.oom_retries,
        record_errors=n.record_errors,
        moved_sessions=n.moved_sessions,
        backpressure_waits=n.backpressure_waits,
        backpressure_wait_seconds=n.backpressure_wait_seconds,
        backpressure_drops=n.backpressure_drops,
        sessions=inp.sessions,
        l4=l4,
    )
