"""SessionFinder: opening a session, and finding it again in memory, in L3 or in L4.

A session in the table (`SessionTable`) is found there; one forgotten from memory, or left in
L3 by an earlier process, comes back from its record (the record on its way to L3 first, else
L3's index); with L4, a session hibernated on another host, or resumed elsewhere since it
hibernated here, comes from its record in Redis (the most recently active record wins). The
SQLite read and the Redis round trip run outside the guard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.keys import SHARED_TENANT, TENANT_MAX_BYTES
from kvtier.cache.sessiontable import from_record
from kvtier.errors import SessionError
from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.session import Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters
    from kvtier.tiers.l3 import L3Store, SessionRecord


@dataclass(eq=False, kw_only=True)
class SessionFinder:
    guard: CacheGuard
    identity: CacheIdentity
    table: SessionTable
    l3: L3Store
    l4: SharedTier | None
    make: Callable[[str, str], Session]  # a new Session of (session id, tenant) on its cache
    counters: Counters

    def open(self, session_id: str, tenant: str = "default") -> Session:
        """Open a session, or find it again (after a restart from L3; hibernated on another
        host, or hibernated here and resumed elsewhere since, from L4)."""
        if not isinstance(session_id, str) or not session_id:
            raise SessionError("session_id must be a non-empty string")
        check_tenant(tenant)
        key = (tenant, session_id)
        with self.guard:
            self.guard.check_open()
            s = self.table.get(key)  # hibernated sessions of earlier processes: from L3
            stored = s is None and self.table.partial  # forgotten (sessiontable): in L3
            if s is not None and (self.l4 is None or s.state is not SessionState.HIBERNATED):
                return s
            if s is None and not stored and self.l4 is None:
                return self._add(self.make(session_id, tenant))
        # outside the lock: an SQLite read of the index, a Redis round trip
        load = self.l3.load_session
        local = (self.table.pending(key) or load(session_id, tenant)) if stored else None
        shared = self.l4.lookup(tenant, session_id) if self.l4 is not None else None
        with self.guard:
            self.guard.check_open()
            s = self.table.get(key)
            recs = [
                r
                for r in (local, shared)
                if r is not None and r.fingerprint == self.identity.fingerprint
            ]
            rec = max(recs, key=lambda r: r.last_active, default=None)
            if s is None:
                s = self.from_record(rec) if rec else self.make(session_id, tenant)
                self._add(s)
            elif rec and s.state is SessionState.HIBERNATED and rec.last_active > s.last_active:
                self.from_record(rec, s)  # hibernated here, resumed elsewhere since
            else:
                return s
            if rec is not None and rec is shared:  # another host served it last: a move
                self.counters.moved_sessions += 1
            return s

    def _add(self, s: Session) -> Session:
        self.table[(s.tenant, s.session_id)] = s
        if self.table.over():  # forget the least recently active (sessiontable)
            self.table.forget_due(time.time(), keep=s)
        return s

    def all(self) -> list[Session]:
        with self.guard:
            return list(self.table.values())

    def find(self, session_id: str, tenant: str) -> Session | None:
        """The session if it is in memory; never reads L3 or L4 (None once forgotten)."""
        with self.guard:
            return self.table.get((tenant, session_id))

    def find_all(self, session_id: str, tenant: str | None = None) -> list[Session]:
        """The sessions of this id (of `tenant`, else of every tenant) in memory, and those
        forgotten from it whose record L3 holds, which come back (an admin's calls)."""
        with self.guard:
            found = [
                s
                for s in self.table.values()
                if s.session_id == session_id and tenant in (None, s.tenant)
            ]
            if not self.table.partial:
                return found
        stored = set(self.l3.index.session_tenants(session_id))  # outside the lock: SQLite
        known = {s.tenant for s in found}
        for t in sorted(stored) if tenant is None else [tenant]:
            if t not in known and (t in stored or self.table.pending((t, session_id))):
                found.append(self.open(session_id, t))
        return found

    def load_hibernated(self) -> None:
        """The hibernated sessions in L3: in memory as far as the bounds of sessiontable keep
        them (the most recently active first), the others found in L3 at their next turn."""
        recs = [r for r in self.l3.list_sessions() if r.fingerprint == self.identity.fingerprint]
        self.table.load(recs, self.from_record)
        if self.l4 is not None:  # chunks this host's L3 lost may still be in L4
            for rec in recs:
                self.l4.note_record(rec)

    def from_record(self, rec: SessionRecord, s: Session | None = None) -> Session:
        """A hibernated session from its record (L3's index, or L4); into `s` if given."""
        s = self.make(rec.session_id, rec.tenant) if s is None else s
        return from_record(s, rec, self.identity.chunk_tokens)


def check_tenant(tenant: str) -> None:
    """A tenant name a session may have, else a SessionError that says why."""
    if not isinstance(tenant, str) or not tenant:
        raise SessionError("tenant must be a non-empty string")
    if tenant == SHARED_TENANT:
        raise SessionError(
            f"tenant {SHARED_TENANT!r} is reserved for published prefixes; use another name"
        )
    size = len(tenant.encode("utf-8", "surrogatepass"))
    if size > TENANT_MAX_BYTES or "\x00" in tenant:
        raise SessionError(
            f"tenant names are at most {TENANT_MAX_BYTES} UTF-8 bytes without NUL (this one is "
            f"{size} bytes); use a shorter name or a hash of it"
        )
