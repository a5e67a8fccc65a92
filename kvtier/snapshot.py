"""The observability contract: frozen, pure snapshot types.

See docs/architecture.md, "Observability".

`TieredCache.stats()` returns a `CacheSnapshot`. The exporter turns it into Prometheus metrics and
kvtop renders it. This module imports nothing but the standard library's typing helpers so that
`ops` can read it without pulling in torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the restore-latency histogram buckets; shared with the exporter.
RESTORE_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class TierStats:
    """One tier's occupancy and hit counters. Counters are totals since the cache started."""

    tier: str  # "l1" | "l2" | "l3" | "l4" (only with a shared tier)
    capacity_bytes: int
    used_bytes: int
    chunks: int
    hits: int = 0  # chunks served from this tier on restore
    misses: int = 0  # chunks looked up here and not found
    evictions: int = 0  # chunks (L2/L3) or sessions' chunks (L1) evicted from this tier


@dataclass(frozen=True)
class TransferStats:
    """Bytes moved and seconds spent for one direction, e.g. src="l1", dst="l2"."""

    src: str
    dst: str
    bytes: int = 0
    seconds: float = 0.0
    ops: int = 0


@dataclass(frozen=True)
class RestoreHistogram:
    """Restore latency for one source; `buckets[i]` counts restores <= RESTORE_BUCKETS[i]."""

    src: str
    buckets: tuple[int, ...]  # cumulative, len == len(RESTORE_BUCKETS)
    count: int
    sum_seconds: float


@dataclass(frozen=True)
class SessionInfo:
    """Per-session detail for kvtop and the admin endpoint (never a metric label)."""

    session_id: str
    tenant: str
    state: str  # a kvtier.types.SessionState value
    pinned: bool
    tokens: int
    bytes: int
    chunks_l1: int
    chunks_l2: int
    chunks_l3: int
    last_active: float  # unix seconds


@dataclass(frozen=True)
class CacheSnapshot:
    """Everything an operator needs to know about a running cache at one instant."""

    taken_at: float
    tiers: tuple[TierStats, ...]
    sessions_by_state: tuple[tuple[str, int], ...] = ()
    transfers: tuple[TransferStats, ...] = ()
    queue_depths: tuple[tuple[str, int], ...] = ()  # ("l2_write", 3), ("l3_write", 0), ...
    restore_decisions: tuple[tuple[str, int], ...] = ()  # ("l2", 10), ("recompute", 2)
    restored_tokens: tuple[tuple[str, int], ...] = ()  # tokens served per source
    restore_latency: tuple[RestoreHistogram, ...] = ()
    checksum_failures: int = 0
    shed_writes: int = 0
    io_errors: int = 0
    oom_retries: int = 0
    record_errors: int = 0  # session records that could not be saved or deleted in L3
    moved_sessions: int = 0  # sessions opened from another host's L4 record (a move)
    # Backpressure: times a commit or an eviction waited for copies to finish (L3 writes to
    # free L2 room, device copies to free in-flight room: kvtier.transfer.inflight), the
    # seconds of those waits, and the stored prefixes cut where waiting could make no room
    # (their tokens are recomputed). Totals since the cache started.
    backpressure_waits: int = 0
    backpressure_wait_seconds: float = 0.0
    backpressure_drops: int = 0
    sessions: tuple[SessionInfo, ...] = field(default=(), compare=False)
    # The shared tier: None without one, else the dict of `L4Store.stats()` (keys up, breaker,
    # bytes_written, bytes_read, hits, misses, errors, writes_shed, get_seconds_sum,
    # get_count, put_seconds_sum, put_count, url); docs/architecture.md, "L4".
    l4: dict[str, Any] | None = field(default=None, compare=False)

    def tier(self, name: str) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == name), None)

    def sessions_in(self, state: str) -> int:
        return dict(self.sessions_by_state).get(state, 0)
