"""The sessions a TieredCache keeps in memory, and the bounds that forget idle ones.

A session in memory costs its token ids and chunk keys (16 KiB for a short conversation, about
36 bytes a token more for a long one), and the server keeps state per session beside it.
`CacheConfig.session_idle_s` and `max_sessions` bound them: an idle session inactive that long,
or past `max_sessions` the least recently active (unpinned first), is *forgotten*: hibernated
as an L1 eviction does (its chunks stay in L2 and go to L3, its record is saved), then dropped
from the table. `TieredCache.session` finds it again from its record (the one on its way to
L3 while it is, else L3's index), and its next turn restores from L2/L3 as any hibernated
session's does. A running session (a restore not yet committed) is never forgotten, and a
handle on a forgotten session stays usable: its next restore puts it back in the table.

Over `max_sessions` the table is cut to 15/16 of it at once, so that the scan behind it runs
once per `max_sessions / 16` new sessions rather than at each one.
"""

from __future__ import annotations

import heapq
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.session import Session
    from kvtier.tiers.l3 import SessionRecord

Key = tuple[str, str]  # (tenant, session id)

# Sessions idle past `idle_s` are looked for every `idle_s / 8` seconds, but at least every
# SCAN_S seconds (a scan of the table under the cache's lock); past max_sessions at once.
SCAN_S = 60.0


class SessionTable(dict[Key, "Session"]):
    """The cache's sessions by (tenant, session id), with the records of those forgotten whose
    save has not landed yet. Every method but `_saved` runs under the cache's lock.

    `hibernate(s)` hibernates a session that is resident or has pages (an eviction: the record
    save is queued, no wait); `record(s)` is its record; `save(rec)` queues a record save and
    `barrier()` a future done once every save queued before it has landed."""

    def __init__(
        self,
        idle_s: float | None,
        max_sessions: int | None,
        *,
        hibernate: Callable[[Session], None],
        record: Callable[[Session], SessionRecord],
        save: Callable[[SessionRecord], Future[Any]],
        barrier: Callable[[], Future[Any]],
    ) -> None:
        super().__init__()
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._hibernate, self._record = hibernate, record
        self._save, self._barrier = save, barrier
        # whether the store may hold a session that is not in the table (one was forgotten,
        # or left in L3 at start): `TieredCache.session` then looks there for an unknown id
        self.partial = False
        self.forgotten = 0  # sessions forgotten since start
        self._pending: dict[Key, SessionRecord] = {}  # forgotten, record not saved yet
        self._guard = threading.Lock()  # `_pending`: its saves land on the record thread
        self._next_scan = 0.0
        self._listeners: list[Callable[[str, str], object]] = []

    def listen(self, fn: Callable[[str, str], object]) -> None:
        """`fn(session_id, tenant)` hears of each session forgotten, under the cache's lock:
        it must not wait, nor call the cache."""
        self._listeners.append(fn)

    def live_keys(self) -> set[bytes]:
        """The chunk keys some session in the table stands on."""
        live: set[bytes] = set()
        for s in self.values():
            live.update(s.chunk_keys)
            if s.tail_key is not None:
                live.add(s.tail_key)
        return live

    def over(self) -> bool:
        return self.max_sessions is not None and len(self) > self.max_sessions

    def keeps(self, last_active: float, now: float) -> bool:
        """Whether a session last active then is kept in memory (loading records at start)."""
        return self.idle_s is None or now - last_active <= self.idle_s

    def load(
        self, records: Sequence[SessionRecord], make: Callable[[SessionRecord], Session]
    ) -> None:
        """Hibernated sessions of earlier processes, from their records: the most recently
        active first, as many as the bounds keep; the others stay in L3 alone (`partial`)."""
        now = time.time()
        cap = len(records) if self.max_sessions is None else self.max_sessions
        for rec in sorted(records, key=lambda r: r.last_active, reverse=True):
            if len(self) < cap and self.keeps(rec.last_active, now):
                self[(rec.tenant, rec.session_id)] = make(rec)
            else:
                self.partial = True

    def pending(self, key: Key) -> SessionRecord | None:
        """The record of a forgotten session whose save has not landed yet."""
        with self._guard:
            return self._pending.get(key)

    def forget_due(self, now: float, keep: Session | None = None) -> int:
        """Forget every idle session past `idle_s`, and while over `max_sessions` the least
        recently active ones (unpinned first; never `keep`); returns how many."""
        over = self.over()
        if not over and (self.idle_s is None or time.monotonic() < self._next_scan):
            return 0
        if self.idle_s is not None:
            self._next_scan = time.monotonic() + min(SCAN_S, self.idle_s / 8)
        idle = [s for s in self.values() if s.state is not SessionState.ACTIVE and s is not keep]
        idle_s = self.idle_s
        due = [s for s in idle if idle_s is not None and now - s.last_active > idle_s]
        if over:
            assert self.max_sessions is not None
            target = self.max_sessions - self.max_sessions // 16
            excess = len(self) - len(due) - target
            if excess > 0:
                chosen = {id(s) for s in due}
                rest = [s for s in idle if id(s) not in chosen]
                due += heapq.nsmallest(excess, rest, key=lambda s: (s.pinned, s.last_active))
        for s in due:
            self.forget(s)
        return len(due)

    def forget(self, s: Session) -> None:
        """Hibernate `s` unless it is, and drop it from the table. A handle on it stays
        usable: its next restore puts it back (`Restorer.check_restorable`)."""
        hibernated = s.state is SessionState.HIBERNATED
        if not hibernated:  # resident, in pages: stored now, its record save queued
            self._hibernate(s)
        key = (s.tenant, s.session_id)
        rec = self._record(s)
        with self._guard:
            self._pending[key] = rec
        # a hibernated session's record may be older than what memory holds (a pin, an abort)
        done = self._save(rec) if hibernated else self._barrier()
        done.add_done_callback(lambda _: self._saved(key, rec))
        self.pop(key, None)
        self.partial = True
        self.forgotten += 1
        for fn in self._listeners:
            fn(s.session_id, s.tenant)

    def _saved(self, key: Key, rec: SessionRecord) -> None:
        """The record is in L3 now (on the record thread)."""
        with self._guard:
            if self._pending.get(key) is rec:
                del self._pending[key]

    def drop_pending(self, tenant: str) -> None:
        """Forget the pending records of `tenant` (a shred)."""
        with self._guard:
            for key in [k for k in self._pending if k[0] == tenant]:
                del self._pending[key]


def from_record(s: Session, rec: SessionRecord, chunk_tokens: int) -> Session:
    """Set `s` to the hibernated session of a record (L3's index, or L4)."""
    s.tokens = tuple(array("i", rec.token_ids))
    n_full = len(s.tokens) // chunk_tokens
    keys = list(rec.chunk_keys)
    s.chunk_keys = keys[:n_full]
    s.tail_key = keys[n_full] if len(keys) > n_full else None
    s.flushed = n_full
    s.pinned = rec.pinned
    s.ttl_s = rec.ttl_s
    s.last_active = rec.last_active
    s.hibernated()
    return s
