"""Access times of L3 chunks: recorded on each read, committed to the index in batches.

The index orders LRU eviction by these times. A read only notes the time; the commit (an
fsync) runs on a background thread once enough are noted, or at close / before gc, never on
a restore's path. Access times are best effort: a failed commit is logged, not raised.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time

from kvtier.errors import StoreError
from kvtier.tiers.l3.index import Index
from kvtier.tiers.l3.pools import IOPools

log = logging.getLogger("kvtier.tiers.l3")  # the store logs under one name
TOUCH_BATCH = 256


class AccessTimes:
    """Access times noted by reads and not yet committed to the index."""

    def __init__(self, index: Index, pools: IOPools, lock: threading.Lock) -> None:
        self._index = index
        self._pools = pools
        self._lock = lock
        self._touched: dict[bytes, float] = {}
        self._pending = False  # a background flush of access times is queued

    def note(self, key: bytes) -> bool:
        """Note that `key` was read now; True when the caller should `flush_soon`."""
        with self._lock:
            self._touched[key] = time.time()
            flush = len(self._touched) >= TOUCH_BATCH and not self._pending
            self._pending |= flush
        return flush

    def flush_soon(self) -> None:
        """Commit the noted times on a background thread, never on a restore's path."""
        self._pools.pool("touch", 1).submit(self._flush_later)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._touched.pop(bytes(key), None)

    def _flush_later(self) -> None:
        with self._lock:
            self._pending = False
        with contextlib.suppress(StoreError):  # closed meanwhile: close() flushed them
            self.flush()

    def flush(self) -> None:
        with self._lock:
            stamps, self._touched = self._touched, {}
        if stamps:
            try:
                self._index.touch(stamps)
            except sqlite3.Error as exc:  # e.g. disk full: access times are best effort
                log.warning("L3 access times not recorded: %s", exc)
