"""TenantShredder: forget every session and chunk of a tenant in every tier (crypto-shred)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.keys import SHARED_TENANT
from kvtier.errors import SessionError
from kvtier.tiers.l3.keys import tenant_chunk_keys
from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.directory import ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.l1room import L1Room
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.lifecycle import SessionLifecycle
    from kvtier.cache.records import SessionRecords
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.tiers.l3 import L3Store, ShredReport
    from kvtier.transfer import TransferEngine


@dataclass(eq=False, kw_only=True)
class TenantShredder:
    guard: CacheGuard
    directory: ChunkDirectory
    engine: TransferEngine
    l3: L3Store
    l4: SharedTier | None
    table: SessionTable
    records: SessionRecords
    room: L1Room
    lifecycle: SessionLifecycle

    def shred(self, tenant: str) -> ShredReport:
        """See `TieredCache.shred_tenant`."""
        if not isinstance(tenant, str) or not tenant or tenant == SHARED_TENANT:
            raise SessionError("shred needs a tenant name (the shared tenant cannot be shredded)")
        with self.guard:
            self.guard.check_open()
            mine = [s for s in self.table.values() if s.tenant == tenant]
            self.table.drop_pending(tenant)
            if any(s.state is SessionState.ACTIVE for s in mine):
                raise SessionError(
                    f"tenant {tenant[:64]!r} has a request running; shred it when it finished"
                )
            sids = {s.session_id for s in mine}
            sids |= {r.session_id for r in self.l3.index.list_sessions() if r.tenant == tenant}
            for s in mine:
                self.room.release(s)
                s.closed()
                self.table.pop((s.tenant, s.session_id), None)
        # Writes in flight (its own among them) land before its key goes; its records are
        # written in order on the record thread: drain it too.
        self.engine.flush()
        self.records.barrier().result()
        report: ShredReport | None = None
        for _ in range(100):
            with self.guard:
                self.lifecycle.reap()
                d = self.directory
                keys = set(tenant_chunk_keys(self.l3.index, tenant))
                keys |= {k for k, e in d.entries.items() if e.tenant == tenant}
                busy = [e for k in keys if (e := d.get(k)) is not None and e.busy]
                if not busy:
                    for k in keys:
                        e = d.get(k)
                        if e is not None:
                            if e.l2_slot is not None:
                                d.free_slot(e)
                            d.entries.pop(k, None)
                        d.forget_l3(k)
                    report = self.l3.shred_tenant(tenant)
                    break
                waits = [f for e in busy for f in (e.l3_read, e.l3_write) if f is not None]
            for f in waits:  # reads and writes of its chunks: outside the lock
                f.exception()
            if not waits:
                time.sleep(0.01)  # a restore is copying from its L2 slot (pinned)
        if report is None:
            raise SessionError(f"tenant {tenant[:64]!r} stays busy; retry the shred")
        if self.l4 is not None:  # outside the lock: the L4 writer may need it to finish
            self.l4.shred(tenant, keys, sids)
        return report
