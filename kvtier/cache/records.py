"""SessionRecords: each session's record in L3's index, written in order on one thread.

A record (`kvtier.tiers.l3.SessionRecord`) names a session's tokens and chunk keys, so that a
restart, or another host through L4, finds the session again. Saves and deletes run on the
record thread in the order they are queued (an SQLite commit never runs on a request's path);
a failure is logged and counted (`CacheSnapshot.record_errors`), never lost.
"""

from __future__ import annotations

import logging
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtier.tiers.l3 import SessionRecord

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.session import Session
    from kvtier.cache.stats import Counters
    from kvtier.tiers.l3 import L3Store

log = logging.getLogger("kvtier.cache")


class SessionRecords:
    def __init__(self, fingerprint: bytes, l3: L3Store, counters: Counters) -> None:
        self.fingerprint = fingerprint
        self._l3 = l3
        self._counters = counters
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvtier-records")

    def record(self, s: Session) -> SessionRecord:
        keys = tuple(s.chunk_keys) + ((s.tail_key,) if s.tail_key else ())
        return SessionRecord(
            session_id=s.session_id,
            tenant=s.tenant,
            fingerprint=self.fingerprint,
            token_ids=array("i", s.tokens).tobytes(),
            chunk_keys=keys,
            pinned=s.pinned,
            ttl_s=s.ttl_s,
            last_active=s.last_active,
            state=s.state.value,
        )

    def save(self, s: Session) -> Future[Any]:
        """Queue a save of the session's record as it is now."""
        return self.save_record(self.record(s))

    def save_record(self, rec: SessionRecord) -> Future[Any]:
        return self._submit(self._l3.save_session, rec)

    def delete(self, session_id: str, tenant: str) -> Future[Any]:
        """Queue the deletion of a record: it lands after any save queued before it."""
        return self._submit(self._l3.delete_session, session_id, tenant)

    def barrier(self) -> Future[Any]:
        """Done once every save and delete queued before it has landed."""
        return self._bg.submit(lambda: None)

    def close(self) -> None:
        """Wait for the queued records, then stop the thread."""
        self._bg.shutdown(wait=True)

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        fut = self._bg.submit(fn, *args)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.error("session record write failed: %s", exc)
            with self._counters.guard:
                self._counters.record_errors += 1
