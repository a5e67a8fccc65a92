"""The L3 store's size cap: room for each put, made by evicting chunks, and evict listeners.

Under `max_bytes`, a put first reserves its bytes beside the puts in flight, evicting
unreferenced chunks (least recently used first) until they fit. Chunks the store deletes on
its own (this cap, and gc) are reported to the evict listeners, outside the store's locks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import StoreFullError
from kvtier.tiers.l3.index import ChunkRow, Index
from kvtier.tiers.l3.stats import Counters

log = logging.getLogger("kvtier.tiers.l3")  # the store logs under one name

# The server's L3 cap when none is given: this share of the filesystem that holds L3, so a
# store left to grow (15,000 short sessions left 2 GB) never fills the disk it shares
DEFAULT_SHARE = 0.5


def default_max_bytes(root: Path, share: float = DEFAULT_SHARE) -> int:
    """`share` of the size of the filesystem holding `root` (its nearest existing parent)."""
    where = Path(root)
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    return max(1, int(st.f_blocks * st.f_frsize * share))


EvictListener = Callable[[list[bytes]], None]
"""Called with the keys of chunks the store deleted by itself (see `add_evict_listener`)."""


class SizeCap:
    """Bytes reserved by puts in flight, eviction down to `max_bytes`, and evict listeners.

    `delete_rows` removes chunks (files and index rows); `lock` is the store's lock for small
    shared state, `room_lock` serialises the check-evict-reserve step of concurrent puts.
    """

    def __init__(
        self,
        max_bytes: int | None,
        index: Index,
        counters: Counters,
        lock: threading.Lock,
        delete_rows: Callable[[list[ChunkRow]], None],
    ) -> None:
        self.max_bytes = max_bytes
        self._index = index
        self._counters = counters
        self._lock = lock
        self._delete_rows = delete_rows
        self.room_lock = threading.Lock()
        self._reserved = 0  # bytes of puts in flight, counted against max_bytes
        self._listeners: list[EvictListener] = []

    def reserve(self, need: int, keep: set[bytes]) -> None:
        """Under a size cap, evict unreferenced chunks (LRU) until `need` more bytes fit beside
        the puts in flight, and count `need` as in flight (the caller releases it)."""
        if self.max_bytes is None:
            with self._lock:
                self._reserved += need
            return
        with self.room_lock:
            _, used = self._index.totals()
            with self._lock:
                used += self._reserved
            victims = []
            if used + need > self.max_bytes:
                for row in self._index.unreferenced_lru():
                    if used + need <= self.max_bytes:
                        break
                    if row.header.key in keep:
                        continue
                    victims.append(row)
                    used -= row.size
            if used + need > self.max_bytes:
                self._counters.count("full_errors")
                raise StoreFullError(
                    f"L3 size cap {self.max_bytes} bytes reached and the remaining chunks are "
                    "referenced by sessions or being written; raise max_bytes or delete sessions"
                )
            if victims:
                self._delete_rows(victims)
                self._counters.count("evictions", len(victims))
            with self._lock:
                self._reserved += need
        self.notify([r.header.key for r in victims])

    def release(self, need: int) -> None:
        """Count `need` bytes of a finished (or failed) put no longer in flight."""
        with self._lock:
            self._reserved -= need

    def add_listener(self, fn: EvictListener) -> None:
        with self._lock:
            self._listeners.append(fn)

    def notify(self, keys: list[bytes]) -> None:
        """Tell the evict listeners about `keys` (call with none of the store's locks held)."""
        if not keys:
            return
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(list(keys))
            except Exception:
                log.exception("L3 evict listener %r failed; the store carries on", fn)
