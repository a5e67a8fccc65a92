"""SessionLifecycle: commit, abort, hibernate and close: the write side of a session's states.

A session is IDLE (its K/V in L1, or in a batch's pages), ACTIVE (a request runs on it, from
its restore to its commit or abort), HIBERNATED (in L2/L3/L4 alone) or CLOSED. Hibernate is
two-phase like restore: under the guard the session's chunks are copied down to L2 and their
L3 writes queued (`ChunkWriter`), and L1 is freed; the wait for those writes (their fsyncs)
and the record's commit happen outside the guard; the write results are published under it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key
from kvtier.cache.restoreplan import common_prefix
from kvtier.errors import SessionError
from kvtier.types import SessionState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.catalog import ChunkCatalog
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.directory import ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l1room import L1Room
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.records import SessionRecords
    from kvtier.cache.session import Ids, Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters
    from kvtier.cache.writes import ChunkSource, ChunkWriter
    from kvtier.tiers.l2 import HostArena
    from kvtier.tiers.l3 import L3Store
    from kvtier.transfer import TransferEngine

log = logging.getLogger("kvtier.cache")


@dataclass(eq=False, kw_only=True)
class SessionLifecycle:
    guard: CacheGuard
    identity: CacheIdentity
    directory: ChunkDirectory
    counters: Counters
    cost: CostModel
    engine: TransferEngine
    l2: HostArena
    l3: L3Store
    l4: SharedTier | None
    table: SessionTable
    records: SessionRecords
    room: L1Room
    writer: ChunkWriter
    catalog: ChunkCatalog

    # -- commit and the write policies ----------------------------------------------------------

    def commit(self, s: Session, ids: Ids) -> None:
        """Commit a turn whose K/V is in the session's L1."""
        with self.guard:
            if s.state is not SessionState.ACTIVE or s.bufs is None:
                raise SessionError("commit() must follow restore() on the same session")
            self._resolve_prefill(s)
            kv_len = min(s.lengths) if s.lengths else 0
            if len(ids) < kv_len:
                kv_len = len(ids)
            if kv_len != len(s.tokens) or ids[:kv_len] != s.tokens:
                s.tail_key = None  # the stored tail is not this one (hibernation stores it)
            s.tokens = ids[:kv_len]
            s.lengths[:] = [kv_len] * len(s.lengths)
            self.writer.write_completed(s)
            s.end_turn()

    def commit_pages(self, s: Session, ids: Ids, start: int, chunks: Sequence[ChunkSource]) -> None:
        """Commit a turn whose K/V lives in a batch's page pool, not in L1 (`paged_l1`): store
        every chunk from `start` on in L2 (and L3, as the write policy does for any chunk),
        the partial tail too. The session is then idle with nothing in L1: its K/V is in the
        batch's pages (`in_pages`) until the batch says they went (`pages_dropped`).

        `chunks[j]` holds tokens `[start + j*C, ...)` of `ids` in the chunk layout on the
        device (full chunks, the last may be partial), or is a function that gathers them
        (`PagePool.gather`, e.g. a `functools.partial`): it is called when that chunk is
        stored, once the chunks gathered before it are within the bound of copies in flight
        (`CacheConfig.inflight_bytes_max`), so a long turn never holds all its chunks on the
        device at once. `start` is a multiple of the chunk size. A chunk that finds no L2 slot
        waits for L3 writes to free one; a stored prefix that stops before `start`, or a chunk
        that finds no slot even so, ends the session there: it keeps only what is stored."""
        C = self.identity.chunk_tokens
        with self.guard:
            if s.state is not SessionState.ACTIVE:
                raise SessionError("commit_pages() must follow a restore of the same session")
            if start % C:
                raise ValueError(f"start {start} is not a multiple of the chunk size {C}")
            if len(chunks) != -(-(len(ids) - start) // C):
                raise ValueError(f"{len(chunks)} chunks do not cover tokens [{start}, {len(ids)})")
            s.take_prefill()
            self.room.release(s)  # any L1 copy of it (a session that was in L1): the pages hold it
            self.unstage(s)
            s.tokens = ids
            s.tail_key = None
            # the chunks before `start` must be stored already: the pages' copy starts there
            del s.chunk_keys[min(s.flushed, start // C) :]
            s.flushed = len(s.chunk_keys)
            if s.flushed * C < start:
                s.cut(s.flushed * C)
            else:
                self.writer.write_completed(s, pages=chunks, start=start)
                self.writer.write_tail(s, pages=chunks, start=start)
            s.end_turn(in_pages=True)
            self.records.save(s)

    def pages_dropped(self, s: Session) -> None:
        """A batch freed the pages of an idle `in_pages` session (`commit_pages`): it is
        hibernated now, in L2/L3 alone."""
        with self.guard:
            if s.in_pages and s.state is SessionState.IDLE:
                s.hibernated()
                self.to_l4(s)

    def abort(self, s: Session) -> None:
        with self.guard:
            s.take_prefill()
            self.unstage(s)
            if s.state is SessionState.ACTIVE:
                s.drop_pages()  # what the pages held past the stored prefix is not committed
            if s.resident:
                s.lengths[:] = [len(s.tokens)] * len(s.lengths)
            if s.resident or s.state is SessionState.ACTIVE:
                s.abort_turn()

    def unstage(self, s: Session) -> None:
        """Unpin a staged restore's prefix (`TieredCache.restore_staged`), if any is left
        (guard held). A slot is reused only after its last device copy is done
        (`TransferEngine.forget`), so a copy still in flight is safe."""
        if s.staged is not None:
            self.directory.unpin(s.staged.chunks)
            s.staged = None

    def _resolve_prefill(self, s: Session) -> None:
        timer = s.take_prefill()
        if timer is not None and (secs := timer.seconds()) is not None:
            # The timer spans layer 0 to the last layer's attention; scale for the last layer.
            layers = len(s.lengths)
            self.cost.observe_prefill(timer.tokens, secs * layers / max(1, layers - 1))

    # -- hibernate / close ------------------------------------------------------------------------

    def hibernate(self, s: Session, *, wait: bool = True) -> None:
        with self.guard:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot hibernate a session while a request is running on it")
            if s.resident:
                self.directory.drain_evictions()
                self.writer.write_completed(s, evicting=True)
                self.writer.write_tail(s)
                self.room.release(s)
            s.drop_pages()
            s.hibernated()  # in pages: stored already (`commit_pages`); the batch frees them
            if not wait:  # an admission eviction: keep the SQLite commit off the request's path
                self.records.save(s)
                self.to_l4(s)
                return
            writes = self.writer.queue_session_writes(s)
        for _, fut in writes:  # the fsyncs: outside the lock
            fut.exception()
        with self.guard:
            for e, fut in writes:
                self.directory.settle_write(e, fut)
            if self.guard.closed or s.state is not SessionState.HIBERNATED:
                return  # closed (close saved it) or restored again meanwhile
            saved = self.records.save(s)
            self.to_l4(s)
        saved.exception()  # in order after every record queued before it; errors are counted

    def evict_one(self, exclude: Session) -> bool:
        """(guard held) Hibernate the least recently active idle resident session other than
        `exclude`, unpinned first: L1 room. False: none is left."""
        candidates = [
            s
            for s in self.table.values()
            if s.resident and s is not exclude and s.state is not SessionState.ACTIVE
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: (s.pinned, s.last_active))
        self.hibernate(victim, wait=False)
        self.counters.evictions[Tier.L1.value] += 1
        return True

    def to_l4(self, s: Session) -> None:
        """Write-behind of a hibernated session to the shared tier (queued, may be shed)."""
        if self.l4 is not None:
            self.l4.enqueue(s, self.records.record(s))

    def close_session(self, s: Session) -> None:
        with self.guard:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot close a session while a request is running on it")
            self.room.release(s)
            s.drop_pages()
            s.closed()
            self.table.pop((s.tenant, s.session_id), None)
            # through the record thread, so it lands after any save queued before it
            self.records.delete(s.session_id, s.tenant)
            if self.l4 is not None:
                self.l4.forget_session(s)

    # -- upkeep ----------------------------------------------------------------------------------

    def reap(self, keep: Session | None = None) -> None:
        """(guard held) Harvest finished writes, L3 evictions and expired sessions; queue shed
        L3 writes again; forget idle sessions past the bounds; reclaim dead entries."""
        self.directory.reap_writes()
        if self.directory.unwritten:
            self.directory.retry_unwritten()
        now = time.time()
        self.table.forget_due(now, keep)
        for s in list(self.table.values()):
            if (
                s is not keep
                and s.ttl_s is not None
                and s.state is not SessionState.ACTIVE
                and now - s.last_active > s.ttl_s
            ):
                self.close_session(s)
        self.directory.sweep(self.table.live_keys)

    def housekeep(self) -> list[Future[Any]]:
        """The upkeep thread's tick (kvtier.cache.upkeep): `reap`; returns the writes to wait
        for while shed L3 writes still wait for room in the queue."""
        with self.guard:
            if self.guard.closed:
                return []
            self.reap()
            return self.directory.retry_unwritten() if self.directory.unwritten else []

    # -- sharing ---------------------------------------------------------------------------------

    def publish_shared(self, ids: Ids, session: Session) -> int:
        """`TieredCache.publish_shared`: the full chunks of a resident session's prefix, under
        the shared namespace, stored for every tenant."""
        with self.guard:
            if not session.resident:
                raise SessionError("publish_shared needs a resident session holding the prefix")
            common = common_prefix(session.tokens, ids)
            C = self.identity.chunk_tokens
            parent = ZERO_KEY
            n = 0
            self.catalog.mark_published()  # before any shared key exists
            for i in range(common // C):
                key = chunk_key(parent, ids[i * C : (i + 1) * C], self.identity.shared_ns)
                e = self.directory.ensure(key, parent, C)
                if not self.directory.stored(e):
                    self.writer.write_down(session, i * C, e, tenant=SHARED_TENANT)
                parent = key
                n += 1
            return n

    def evict_l2(self) -> int:
        """Drop every L2 copy that is durable in L3 (frees host RAM); returns chunks dropped."""
        self.engine.flush()  # waits for the disk: outside the lock
        with self.guard:
            self.reap()
            return self.directory.drop_l2_durable()

    def flush(self) -> None:
        """Wait for every queued L3 write."""
        self.engine.flush()
        with self.guard:
            self.reap()

    def close_all(self, stop_upkeep: Callable[[], None]) -> None:
        """Hibernate every resident session to L3, then release every resource. Idempotent."""
        stop_upkeep()
        with self.guard:
            if self.guard.closed:
                return
            self.guard.wait_loads()  # let restores in their load phase publish first
            for s in list(self.table.values()):
                if s.state is SessionState.ACTIVE:
                    self.abort(s)
                if s.resident:
                    self.hibernate(s, wait=False)
                elif s.in_pages:  # stored already: only its L3 writes and record below
                    s.drop_pages()
                    s.hibernated()
            self.engine.flush()
            while self.directory.unwritten:  # shed writes (of forgotten sessions too)
                self.directory.retry_unwritten()
                self.engine.flush()
            self.reap()
            for s in list(self.table.values()):
                if s.state is SessionState.HIBERNATED:
                    for e, fut in self.writer.queue_session_writes(s):
                        fut.exception()
                        self.directory.settle_write(e, fut)
                    self.records.save(s)
            if self.l4 is not None:  # its queued writes read L3, which is still open
                self.l4.close()
            self.guard.mark_closed()
            self.records.close()
            self.engine.close()
            self.l2.close()
            self.l3.close()
