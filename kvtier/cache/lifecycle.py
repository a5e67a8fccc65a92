"""Commit, the write policies, hibernate, close and sharing: the write side of TieredCache.

Hibernate is two-phase like restore: under the lock the session's chunks are copied down to
L2 and their L3 writes queued, and L1 is freed; the wait for those writes (their fsyncs) and
the record's commit happen outside the lock; the write results are published under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache import pages as _pages
from kvtier.cache import relocate as _relocate
from kvtier.cache.directory import Chunk, ChunkDirectory
from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key
from kvtier.cache.restore import common_prefix
from kvtier.cache.session import Ids, Session, as_ids
from kvtier.errors import SessionError
from kvtier.tiers.l3.keys import tenant_chunk_keys
from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.config import CacheConfig
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters
    from kvtier.cache.upkeep import Upkeep
    from kvtier.geometry import KVGeometry
    from kvtier.integrations.hf import KvtierCache
    from kvtier.tiers.l2 import HostArena
    from kvtier.tiers.l3 import L3Store, SessionRecord, ShredReport
    from kvtier.transfer import TransferEngine

log = logging.getLogger("kvtier.cache")

ChunkSource = torch.Tensor | Callable[[], torch.Tensor]
"""A chunk of K/V from a batch's pages for `commit_pages`: the tensor, or a function that
gathers it (called when the chunk is stored, under the bound of copies in flight)."""


class LifecycleMixin:
    """The write side of `TieredCache` (see the module docstring)."""

    config: CacheConfig
    chunk_tokens: int
    geometry: KVGeometry
    directory: ChunkDirectory
    counters: Counters
    cost: CostModel
    engine: TransferEngine
    l2: HostArena
    l3: L3Store
    _lock: threading.RLock
    _idle: threading.Condition
    _restoring: int
    _closed: bool
    _published: bool
    _sessions: SessionTable
    _upkeep: Upkeep
    _bg: ThreadPoolExecutor
    l4: SharedTier | None

    if TYPE_CHECKING:  # pragma: no cover

        def _reap(self, keep: Session | None = None) -> None: ...
        def session(self, session_id: str, tenant: str = "default") -> Session: ...
        def _record(self, s: Session) -> SessionRecord: ...
        def _submit_record(self, fn: Any, *args: Any) -> Future[Any]: ...
        def _release_l1(self, s: Session) -> None: ...
        def key_for(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes: ...
        @property
        def _shared_ns(self) -> bytes: ...

    # -- commit and the write policies ----------------------------------------------------------

    def commit_session(self, s: Session, ids: Ids) -> None:
        if s.pages is not None:  # restored into a caller's page pool
            _pages.commit(self, s, ids)  # type: ignore[arg-type]
            return
        with self._lock:
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
            self._write_completed_chunks(s)
            s.state = SessionState.IDLE
            s.last_active = time.time()

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
        C = self.chunk_tokens
        with self._lock:
            if s.state is not SessionState.ACTIVE:
                raise SessionError("commit_pages() must follow a restore of the same session")
            if start % C:
                raise ValueError(f"start {start} is not a multiple of the chunk size {C}")
            if len(chunks) != -(-(len(ids) - start) // C):
                raise ValueError(f"{len(chunks)} chunks do not cover tokens [{start}, {len(ids)})")
            s._prefill = None
            self._release_l1(s)  # any L1 copy of it (a session that was in L1): the pages hold it
            self._unstage(s)
            s.tokens = ids
            s.tail_key = None
            # the chunks before `start` must be stored already: the pages' copy starts there
            del s.chunk_keys[min(s.flushed, start // C) :]
            s.flushed = len(s.chunk_keys)
            if s.flushed * C < start:
                self._cut(s, s.flushed * C)
            else:

                def at(pos: int) -> ChunkSource:
                    return chunks[(pos - start) // C]

                self._write_completed_chunks(s, chunk_at=at)
                self._write_tail(s, chunk_at=at)
            s.state = SessionState.IDLE
            s.in_pages = True
            s.last_active = time.time()
            self._submit_record(self.l3.save_session, self._record(s))

    def pages_dropped(self, s: Session) -> None:
        """A batch freed the pages of an idle `in_pages` session (`commit_pages`): it is
        hibernated now, in L2/L3 alone."""
        with self._lock:
            if s.in_pages and s.state is SessionState.IDLE:
                s.in_pages = False
                s.state = SessionState.HIBERNATED
                self._to_l4(s)

    def abort_session(self, s: Session) -> None:
        with self._lock:
            s._prefill = None
            self._unstage(s)
            if s.state is SessionState.ACTIVE:
                _pages.drop(s)  # what the pages held past the stored prefix is not committed
            if s.resident:
                s.lengths[:] = [len(s.tokens)] * len(s.lengths)
                s.state = SessionState.IDLE
            elif s.state is SessionState.ACTIVE:
                s.state = SessionState.HIBERNATED

    def _unstage(self, s: Session) -> None:
        """Unpin a staged restore's prefix (`TieredCache.restore_staged`), if any is left
        (under the lock). A slot is reused only after its last device copy is done
        (`TransferEngine.forget`), so a copy still in flight is safe."""
        if s.staged is not None:
            for e in s.staged.chunks:
                e.pins -= 1
            s.staged = None

    def _resolve_prefill(self, s: Session) -> None:
        timer, s._prefill = s._prefill, None
        if timer is not None and (secs := timer.seconds()) is not None:
            # The timer spans layer 0 to the last layer's attention; scale for the last layer.
            layers = len(s.lengths)
            self.cost.observe_prefill(timer.tokens, secs * layers / max(1, layers - 1))

    def _write_completed_chunks(
        self,
        s: Session,
        *,
        evicting: bool = False,
        chunk_at: Callable[[int], ChunkSource] | None = None,
    ) -> None:
        """Key every newly completed full chunk and apply the write policy to it.

        When evicting, a chunk that finds no L2 slot (every slot in flight) waits for L3
        writes to free one (backpressure); where waiting cannot (nothing in flight to wait
        for) it ends the session's stored prefix there, counted as a drop: the session keeps
        only what is stored somewhere. `chunk_at(pos)`: the K/V of the chunk at token `pos`
        from a batch's pages (`commit_pages`; a tensor or a function gathering it), where L1
        holds none: every new chunk is then stored, as when evicting, from `s.flushed` on."""
        C = self.chunk_tokens
        n_full = len(s.tokens) // C
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        for i in range(len(s.chunk_keys), n_full):
            parent = self.key_for(parent, s.tokens[i * C : (i + 1) * C], s)
            s.chunk_keys.append(parent)
        d = self.directory
        policy = self.config.write_policy
        # Evicting, every chunk is checked again: L3 may have dropped one (size cap) after L2
        # let its copy go, and L1 holds the last copy now.
        must = evicting or chunk_at is not None  # L1 will not hold the chunk after this
        for i in range(0 if evicting else s.flushed, n_full):
            e = d.ensure(s.chunk_keys[i], s.chunk_keys[i - 1] if i else ZERO_KEY, C)
            e.seen += i >= s.flushed
            if d.stored(e):
                continue  # already stored once (prefix shared with another session)
            if not (
                must
                or policy == "write_through"
                or (
                    policy == "write_through_selective" and e.seen >= self.config.selective_min_hits
                )
            ):
                continue
            chunk = None if chunk_at is None else chunk_at(i * C)
            if not self._write_down(s, i * C, e, tenant=s.tenant, chunk=chunk, wait=must) and must:
                log.warning(
                    "L2 has no free slot for chunk %s leaving L1; session %r keeps %d tokens",
                    e.key.hex(),
                    s.session_id[:64],
                    i * C,
                )
                self.counters.count_drop()
                self._cut(s, i * C)
                return
            del chunk  # a gathered chunk is the engine's (in flight) from here
        # Only chunks that were written (or already stored) count as flushed.
        while s.flushed < n_full:
            e2 = d.get(s.chunk_keys[s.flushed])
            if e2 is None or not d.stored(e2):
                break
            s.flushed += 1

    def _cut(self, s: Session, n: int) -> None:
        """Keep only the first `n` tokens (a multiple of the chunk size) of the session."""
        s.tokens = s.tokens[:n]
        del s.chunk_keys[n // self.chunk_tokens :]
        s.flushed = min(s.flushed, len(s.chunk_keys))
        s.lengths[:] = [n] * len(s.lengths)
        s.tail_key = None

    def _write_down(
        self,
        s: Session,
        pos: int,
        e: Chunk,
        *,
        tenant: str,
        chunk: ChunkSource | None = None,
        wait: bool = False,
    ) -> bool:
        """L1 -> L2 now (one D2H copy), then L2 -> L3 queued (shed if the queue is full).
        `chunk`: the chunk's K/V already in the chunk layout on the device (a batch's pages,
        `commit_pages`), or a function that gathers it, instead of the session's L1. `wait`:
        when every L2 slot is in flight, wait for L3 writes to free one (`_l2_slot`). False if
        L2 has no slot that is not in flight (the chunk is not stored)."""
        slot = self._l2_slot(wait)
        if slot is None:
            return False
        if chunk is not None:
            self._offload_chunk(chunk, slot)
        else:
            assert s.bufs is not None
            # the last copy from the session's L1: its release waits for it or counts it
            s.bufs.copy = self.engine.offload(
                s.bufs.layers, pos, e.tokens, slot, block=s.bufs.block
            )
        e.l2_slot = slot
        e.tenant = tenant
        self.directory.policy.touch(e.key)
        self.directory.queue_write(e)
        self.counters.stored["chunks"] += 1
        self.counters.stored["tokens"] += e.tokens
        return True

    def _l2_slot(self, wait: bool) -> int | None:
        """A free L2 slot (`ChunkDirectory.alloc`). With `wait`, while every slot is in flight
        (L3 writes of chunks L2 alone holds, reads), wait for one of those to finish and try
        again (backpressure: counted, seconds too); None once nothing is left to wait for."""
        d = self.directory
        slot = d.alloc()
        while slot is None and wait:
            waited = d.wait_for_room()
            if waited is None:
                break
            self.counters.count_wait(waited)
            slot = d.alloc()
        return slot

    def _offload_chunk(self, chunk: ChunkSource, slot: int) -> None:
        """Copy a chunk from pages into `slot`; a function gathers it once the bound of
        copies in flight has room for it (`Inflight.take`), so it is never held beyond."""
        if not callable(chunk):
            self.engine.offload_chunk(chunk, slot)
            return
        inflight = self.engine.inflight
        ticket = inflight.take(self.geometry.chunk_bytes(self.chunk_tokens))
        try:
            data = chunk()
        except BaseException:
            inflight.give_back(ticket)
            raise
        self.engine.offload_chunk(data, slot, ticket=ticket)

    def _write_tail(self, s: Session, chunk_at: Callable[[int], ChunkSource] | None = None) -> None:
        C = self.chunk_tokens
        t = len(s.tokens) % C
        if t == 0:
            s.tail_key = None
            return
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        key = chunk_key(parent, s.tokens[-t:], s.ns)
        e = self.directory.ensure(key, parent, t)
        pos = len(s.tokens) - t
        chunk = None if chunk_at is None else chunk_at(pos)
        if not self.directory.stored(e):
            if not self._write_down(s, pos, e, tenant=s.tenant, chunk=chunk, wait=True):
                self.counters.count_drop()
                self._cut(s, len(s.tokens) - t)  # the tail is recomputed on resume
                return
            self.counters.stored["tails"] += 1
            self.counters.stored["tail_tokens"] += t
        s.tail_key = key

    # -- hibernate / close ------------------------------------------------------------------------

    def hibernate_session(self, s: Session, *, wait: bool = True) -> None:
        with self._lock:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot hibernate a session while a request is running on it")
            if s.resident:
                self.directory.drain_evictions()
                self._write_completed_chunks(s, evicting=True)
                self._write_tail(s)
                self._release_l1(s)
            _pages.drop(s)
            s.in_pages = False  # stored already (`commit_pages`); the batch frees the pages
            s.state = SessionState.HIBERNATED
            if not wait:  # an admission eviction: keep the SQLite commit off the request's path
                self._submit_record(self.l3.save_session, self._record(s))
                self._to_l4(s)
                return
            writes = self._queue_session_writes(s)
        for _, fut in writes:  # the fsyncs: outside the lock
            fut.exception()
        with self._lock:
            for e, fut in writes:
                self.directory.settle_write(e, fut)
            if self._closed or s.state is not SessionState.HIBERNATED:
                return  # closed (close saved it) or restored again meanwhile
            saved = self._submit_record(self.l3.save_session, self._record(s))
            self._to_l4(s)
        saved.exception()  # in order after every record queued before it; errors are counted

    def _to_l4(self, s: Session) -> None:
        """Write-behind of a hibernated session to the shared tier (queued, may be shed)."""
        if self.l4 is not None:
            self.l4.enqueue(s, self._record(s))

    def _queue_session_writes(self, s: Session) -> list[tuple[Chunk, Future[Any]]]:
        """Queue L3 writes of the session's chunks that only L2 holds; returns the writes in
        flight on its chunks."""
        d = self.directory
        d.reap_writes()
        writes = []
        for key in [*s.chunk_keys] + ([s.tail_key] if s.tail_key else []):
            e = d.get(key)
            if e is None:
                continue
            if not d.in_l3(key) and e.l3_write is None and e.l2_slot is not None:
                d.queue_write(e)
            if e.l3_write is not None:
                writes.append((e, e.l3_write))
        return writes

    def close_session(self, s: Session) -> None:
        with self._lock:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot close a session while a request is running on it")
            self._release_l1(s)
            _pages.drop(s)
            s.state = SessionState.CLOSED
            self._sessions.pop((s.tenant, s.session_id), None)
            # through the record thread, so it lands after any save queued before it
            self._submit_record(self.l3.delete_session, s.session_id, s.tenant)
            if self.l4 is not None:
                self.l4.forget_session(s)

    # -- forgetting idle sessions (kvtier.cache.sessiontable) and the upkeep thread -------------

    def find_session(self, session_id: str, tenant: str) -> Session | None:
        """The session if it is in memory; never reads L3 or L4 (None once forgotten)."""
        with self._lock:
            return self._sessions.get((tenant, session_id))

    def find_sessions(self, session_id: str, tenant: str | None = None) -> list[Session]:
        """The sessions of this id (of `tenant`, else of every tenant) in memory, and those
        forgotten from it whose record L3 holds, which come back (an admin's calls)."""
        with self._lock:
            found = [
                s
                for s in self._sessions.values()
                if s.session_id == session_id and tenant in (None, s.tenant)
            ]
            if not self._sessions.partial:
                return found
        stored = set(self.l3.index.session_tenants(session_id))  # outside the lock: SQLite
        known = {s.tenant for s in found}
        for t in sorted(stored) if tenant is None else [tenant]:
            if t not in known and (t in stored or self._sessions.pending((t, session_id))):
                found.append(self.session(session_id, t))
        return found

    def on_forget(self, fn: Callable[[str, str], object]) -> None:
        """`fn(session_id, tenant)` hears of each session forgotten from memory (idle past
        `session_idle_s`, or past `max_sessions`), under the cache's lock: it must neither
        wait nor call the cache."""
        self._sessions.listen(fn)

    def _housekeep(self) -> list[Future[Any]]:
        """The upkeep thread's tick (kvtier.cache.upkeep): `_reap`; returns the writes to wait
        for while shed L3 writes still wait for room in the queue."""
        with self._lock:
            if self._closed:
                return []
            self._reap()
            return self.directory.retry_unwritten() if self.directory.unwritten else []

    # -- moving L1 to another device (device failover) ---------------------------------------------

    def move_l1(self, device: torch.device, budget: int | None = None, lost: bool = True) -> int:
        """A new, empty L1 on `device`; returns the old budget (`kvtier.cache.relocate`)."""
        return _relocate.relocate_l1(self, device, budget, lost)  # type: ignore[arg-type]

    def reload_session(self, s: Session, ids: Ids) -> KvtierCache:
        """After `move_l1`: restore a running request's session into the new L1."""
        return _relocate.reload_session(self, s, ids)  # type: ignore[arg-type]

    # -- sharing ---------------------------------------------------------------------------------

    def publish_shared(self, input_ids: torch.Tensor | Sequence[int], session: Session) -> int:
        """Publish the full chunks of a resident session's prefix to every tenant.

        Returns the number of chunks published. Use it for system prompts and tool schemas
        that are not secret; everything else stays per tenant. Published chunks are written to
        L3 under the shared tenant, so a restarted cache serves them too.
        """
        ids = as_ids(input_ids)
        with self._lock:
            if not session.resident:
                raise SessionError("publish_shared needs a resident session holding the prefix")
            common = common_prefix(session.tokens, ids)
            C = self.chunk_tokens
            parent = ZERO_KEY
            n = 0
            self._published = True  # before any shared key exists (key_for looks from now on)
            for i in range(common // C):
                key = chunk_key(parent, ids[i * C : (i + 1) * C], self._shared_ns)
                e = self.directory.ensure(key, parent, C)
                if not self.directory.stored(e):
                    self._write_down(session, i * C, e, tenant=SHARED_TENANT)
                parent = key
                n += 1
            return n

    def evict_l2(self) -> int:
        """Drop every L2 copy that is durable in L3 (frees host RAM); returns chunks dropped."""
        self.engine.flush()  # waits for the disk: outside the lock
        with self._lock:
            self._reap()
            return self.directory.drop_l2_durable()

    # -- crypto-shred ------------------------------------------------------------------------------

    def shred_tenant(self, tenant: str) -> ShredReport:
        """Forget every session and chunk of `tenant` in every tier, and destroy its data key.

        L1 and L2 copies are dropped now and its sessions closed without a record; in L3 the
        tenant's data key and session records are destroyed in one transaction
        (`L3Store.shred_tenant`), so its chunk files are unreadable at once and the next gc
        removes them (a plain store deletes them now). Its next request recomputes. Raises
        SessionError while one of its sessions has a request running (retry after it).

        With L4, the tenant's data keys, session records and the chunks this host knows of
        leave Redis as well (best effort: `SharedTier.shred`); a sealed value left there names
        a destroyed key and is a miss on every host."""
        if not isinstance(tenant, str) or not tenant or tenant == SHARED_TENANT:
            raise SessionError("shred needs a tenant name (the shared tenant cannot be shredded)")
        with self._lock:
            self._check_open()
            mine = [s for s in self._sessions.values() if s.tenant == tenant]
            self._sessions.drop_pending(tenant)
            if any(s.state is SessionState.ACTIVE for s in mine):
                raise SessionError(
                    f"tenant {tenant[:64]!r} has a request running; shred it when it finished"
                )
            sids = {s.session_id for s in mine}
            sids |= {r.session_id for r in self.l3.index.list_sessions() if r.tenant == tenant}
            for s in mine:
                self._release_l1(s)
                s.state = SessionState.CLOSED
                self._sessions.pop((s.tenant, s.session_id), None)
        # Writes in flight (its own among them) land before its key goes; its records are
        # written in order on the record thread: drain it too.
        self.engine.flush()
        self._bg.submit(lambda: None).result()
        report: ShredReport | None = None
        for _ in range(100):
            with self._lock:
                self._reap()
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

    # -- lifecycle -------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued L3 write."""
        self.engine.flush()
        with self._lock:
            self._reap()

    def close(self) -> None:
        """Hibernate every resident session to L3, then release every resource. Idempotent."""
        self._upkeep.stop()
        with self._lock:
            if self._closed:
                return
            while self._restoring:  # let restores in their load phase publish first
                self._idle.wait()
            for s in list(self._sessions.values()):
                if s.state is SessionState.ACTIVE:
                    self.abort_session(s)
                if s.resident:
                    self.hibernate_session(s, wait=False)
                elif s.in_pages:  # stored already: only its L3 writes and record below
                    _pages.drop(s)
                    s.in_pages, s.state = False, SessionState.HIBERNATED
            self.engine.flush()
            while self.directory.unwritten:  # shed writes (of forgotten sessions too)
                self.directory.retry_unwritten()
                self.engine.flush()
            self._reap()
            for s in list(self._sessions.values()):
                if s.state is SessionState.HIBERNATED:
                    for e, fut in self._queue_session_writes(s):
                        fut.exception()
                        self.directory.settle_write(e, fut)
                    self._submit_record(self.l3.save_session, self._record(s))
            if self.l4 is not None:  # its queued writes read L3, which is still open
                self.l4.close()
            self._closed = True
            self._bg.shutdown(wait=True)
            self.engine.close()
            self.l2.close()
            self.l3.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("this TieredCache is closed")
