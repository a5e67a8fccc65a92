"""Counters of an L3 store (totals since this process opened it) and their snapshot type."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class L3Stats:
    """Occupancy and counters of one store (counters are totals since this process opened it)."""

    capacity_bytes: int
    used_bytes: int
    chunks: int
    sessions: int
    reads: int = 0
    reads_direct: int = 0  # served with O_DIRECT from the device
    reads_cached: int = 0  # served through the page cache because the pages were resident
    reads_buffered: int = 0  # buffered because the filesystem or buffer refused O_DIRECT
    misses: int = 0
    writes: int = 0
    checksum_failures: int = 0
    format_errors: int = 0
    fingerprint_mismatches: int = 0
    quarantined: int = 0
    full_errors: int = 0  # ENOSPC or size cap
    io_errors: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


COUNTERS = tuple(
    f
    for f in L3Stats.__dataclass_fields__
    if f
    not in ("capacity_bytes", "used_bytes", "chunks", "sessions", "read_seconds", "write_seconds")
)


class Counters:
    """The store's event counters and time totals, updated under the store's lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._seconds = {"read_seconds": 0.0, "write_seconds": 0.0}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def wrote(self, chunks: int, nbytes: int, seconds: float) -> None:
        """Count `chunks` chunks of `nbytes` file bytes put in `seconds`."""
        with self._lock:
            self._counts["writes"] += chunks
            self._counts["bytes_written"] += nbytes
            self._seconds["write_seconds"] += seconds

    def read(self, route: str, nbytes: int, seconds: float) -> None:
        """Count one read of `nbytes` file bytes served by `route` (a reads_* counter)."""
        with self._lock:
            self._counts["reads"] += 1
            self._counts[route] += 1
            self._counts["bytes_read"] += nbytes
            self._seconds["read_seconds"] += seconds

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        """(counters, seconds) as of now."""
        with self._lock:
            return dict(self._counts), dict(self._seconds)
