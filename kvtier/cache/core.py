"""TieredCache: the orchestrator of the tiers (L1 GPU, L2 pinned host, L3 SSD).

Data model
- A session's KV lives in L1 while it is resident (`SessionBuffers`, exact attention reads it).
- Every *full* chunk of a session has a content key (`keys.chain`). The `ChunkDirectory` maps
  a key to where copies exist: an L2 slot and/or an L3 file. Equal prefixes share one entry.
- A session's tail (tokens after its last full chunk) is written as a partial chunk only when
  the session leaves L1 (hibernate or eviction), so the session resumes whole.

Threading: one re-entrant lock guards the metadata (sessions, directory, counters). It is held
only for bookkeeping and for starting transfers, never across a wait for the disk: restore
(`kvtier.cache.restore`) and hibernate plan under the lock, wait for reads, throttle sleeps,
copies and fsyncs outside it, and publish under it again; `stats()` copies numbers under the
lock and asks the store and the engine outside it. The model's forward runs outside it; a
session is never evicted while a request is running on it (state ACTIVE).

Device memory is bounded (`device_bytes`): L1's budget, the staging buffers, and the copies in
flight (`TransferEngine.inflight`: L1 blocks released while their chunks still go down, chunks
gathered from pages) under `CacheConfig.inflight_bytes_max`. At a bound the cache waits rather
than holding more (backpressure, counted): a session leaving L1 whose chunks find every L2 slot
busy with an L3 write waits for one to finish (`ChunkDirectory.wait_for_room`), and a release
past the in-flight bound waits for the oldest copies. These waits, like a write-back, run under
the lock; only where nothing is left to wait for is the session's stored prefix cut (counted as
a drop, recomputed at its next turn).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvtier.cache import pages as _pages
from kvtier.cache import restore as _restore
from kvtier.cache.config import CacheConfig
from kvtier.cache.costmodel import CostModel
from kvtier.cache.directory import Chunk, ChunkDirectory
from kvtier.cache.keys import SHARED_TENANT, TENANT_MAX_BYTES, chunk_key, namespace
from kvtier.cache.l4 import SharedTier
from kvtier.cache.lifecycle import LifecycleMixin
from kvtier.cache.restore import StagedPrefix, common_prefix
from kvtier.cache.session import Ids, Session
from kvtier.cache.sessiontable import SessionTable, from_record
from kvtier.cache.stats import Counters, SnapshotInputs, build_snapshot
from kvtier.cache.tierset import open_tiers
from kvtier.cache.upkeep import Upkeep
from kvtier.codecs import make_codec
from kvtier.errors import L1BudgetExceeded, SessionError
from kvtier.geometry import KVGeometry, model_fingerprint, normalize_dtype
from kvtier.integrations.hf import KvtierCache
from kvtier.integrations.paged_cache import PagedCache
from kvtier.kvbin import ChunkHeader
from kvtier.paged.pool import PagePool
from kvtier.policy import make_policy
from kvtier.snapshot import RESTORE_BUCKETS, CacheSnapshot
from kvtier.tiers.l3 import SessionRecord
from kvtier.transfer.staging import Handle
from kvtier.types import SessionState
from kvtier.weights import weights_digest

log = logging.getLogger("kvtier.cache")


class TieredCache(LifecycleMixin):
    """KV cache of many sessions across GPU memory (L1), pinned host RAM (L2) and SSD (L3)."""

    def __init__(self, config: CacheConfig, model: Any) -> None:
        config.__post_init__()  # settings changed after construction are checked again
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.model = model
        self.device = torch.device(getattr(model, "device", "cpu"))
        dtype = normalize_dtype(getattr(model, "dtype", torch.float32))
        self.geometry = KVGeometry.from_config(model.config, dtype=dtype)
        model_id = config.model_id or getattr(model.config, "_name_or_path", "") or "unnamed"
        self.fingerprint = model_fingerprint(
            model.config,
            self.geometry,
            model_id=model_id,
            codec=config.codec,
            weights_digest=weights_digest(model),
        )
        self.codec = make_codec(config.codec, self.geometry)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a restore publishes
        self._restoring = 0  # restores between their plan and their publish
        self._closed = False
        self._sessions = SessionTable(
            config.session_idle_s,
            config.max_sessions,
            hibernate=functools.partial(self.hibernate_session, wait=False),
            record=self._record,
            save=lambda rec: self._submit_record(self.l3.save_session, rec),
            barrier=lambda: self._bg.submit(lambda: None),
        )
        self.counters = Counters()
        # Every resource is released again if a later step fails (reopening the root works).
        with contextlib.ExitStack() as undo:
            self.l1, self.l3, self.l2, self.engine = open_tiers(
                config, self.geometry, self.codec, self.device, self.counters, undo
            )
            self.cost = CostModel(
                {"l4": 1e9, **config.initial_bandwidth},
                config.initial_prefill_s_per_token,
                margin=config.load_margin,
            )
            # Keys (-> token count) of this model's chunks in L3, loaded once: the hot path
            # never queries the SQLite index, whose writers hold its lock across a commit.
            l3_tokens: dict[bytes, int] = {}
            self._published = False  # some prefix is published to every tenant
            for row in self.l3.index.iter_chunks():
                if row.header.fingerprint == self.fingerprint:
                    l3_tokens[row.header.key] = row.header.tokens
                    self._published |= row.header.tenant == SHARED_TENANT
            self.directory = ChunkDirectory(
                self.l2,
                self.engine,
                make_policy(config.l2_policy),
                l3_tokens,
                self._header,
                self.counters,
            )
            # the store reports what its size cap and gc delete; see ChunkDirectory
            self.l3.add_evict_listener(self.directory.on_l3_evicted)
            self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvtier-records")
            undo.callback(self._bg.shutdown, wait=True)
            self.l4: SharedTier | None = None
            if config.l4_url is not None:  # the shared tier; Redis may be down: it degrades
                self.l4 = SharedTier(self)
                undo.callback(self.l4.close)
            self._load_hibernated()
            self.directory.retry_shed = config.write_policy != "write_back"
            bound = config.l3_write_bound_s
            self._upkeep = Upkeep(min(1.0, max(0.05, (bound or 4.0) / 4)), self._housekeep)
            undo.pop_all()

    # -- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str, tenant: str = "default") -> Session:
        """Open a session, or find it again (after a restart from L3; hibernated on another
        host, or hibernated here and resumed elsewhere since, from L4)."""
        if not isinstance(session_id, str) or not session_id:
            raise SessionError("session_id must be a non-empty string")
        _check_tenant(tenant)
        key = (tenant, session_id)
        with self._lock:
            self._check_open()
            s = self._sessions.get(key)  # hibernated sessions of earlier processes: from L3
            stored = s is None and self._sessions.partial  # forgotten (sessiontable): in L3
            if s is not None and (self.l4 is None or s.state is not SessionState.HIBERNATED):
                return s
            if s is None and not stored and self.l4 is None:
                return self._add_session(Session(self, session_id, tenant))
        # outside the lock: an SQLite read of the index, a Redis round trip
        load = self.l3.load_session
        found = [self._sessions.pending(key) or load(session_id, tenant)] if stored else []
        if self.l4 is not None:
            found.append(self.l4.lookup(tenant, session_id))
        with self._lock:
            self._check_open()
            s = self._sessions.get(key)
            recs = [r for r in found if r is not None and r.fingerprint == self.fingerprint]
            rec = max(recs, key=lambda r: r.last_active, default=None)
            if s is None:
                s = self._from_record(rec) if rec else Session(self, session_id, tenant)
                self._add_session(s)
            elif rec and s.state is SessionState.HIBERNATED and rec.last_active > s.last_active:
                self._from_record(rec, s)  # hibernated here, resumed elsewhere since
            return s

    def _add_session(self, s: Session) -> Session:
        self._sessions[(s.tenant, s.session_id)] = s
        if self._sessions.over():  # forget the least recently active (sessiontable)
            self._sessions.forget_due(time.time(), keep=s)
        return s

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def _load_hibernated(self) -> None:
        """The hibernated sessions in L3: in memory as far as the bounds of sessiontable keep
        them (the most recently active first), the others found in L3 at their next turn."""
        recs = [r for r in self.l3.list_sessions() if r.fingerprint == self.fingerprint]
        self._sessions.load(recs, self._from_record)
        if self.l4 is not None:  # chunks this host's L3 lost may still be in L4
            for rec in recs:
                self.l4.note_record(rec)

    def _from_record(self, rec: SessionRecord, s: Session | None = None) -> Session:
        """A hibernated session from its record (L3's index, or L4); into `s` if given."""
        s = Session(self, rec.session_id, rec.tenant) if s is None else s
        return from_record(s, rec, self.chunk_tokens)

    def _record(self, s: Session) -> SessionRecord:
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

    def _submit_record(self, fn: Any, *args: Any) -> Future[Any]:
        """Save or delete a record on the record thread (in order); a failure is logged and
        counted (`CacheSnapshot.record_errors`), never lost."""
        fut = self._bg.submit(fn, *args)
        fut.add_done_callback(self._record_done)
        return fut

    def _record_done(self, fut: Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.error("session record write failed: %s", exc)
            with self.counters.guard:
                self.counters.record_errors += 1

    # -- the host API that `Session` calls (session.SessionHost) --------------------------------

    def restore_session(self, s: Session, ids: Ids) -> KvtierCache:
        cache = self._restore(s, ids, stage=False)
        assert isinstance(cache, KvtierCache)
        return cache

    def restore_into(self, s: Session, ids: Ids, pool: PagePool) -> PagedCache:
        """`Session.restore(ids, pool=pool)` (kvtier.cache.pages)."""
        return _pages.restore(self, s, ids, pool)

    def reserve_pages(self, view: PagedCache, tokens: int) -> None:
        """Room for `tokens` tokens in a session's pages (`PagedCache`'s owner; see
        `kvtier.cache.pages.reserve`)."""
        _pages.reserve(self, view, tokens)

    def _check_restorable(self, s: Session) -> None:
        self._check_open()
        key = (s.tenant, s.session_id)  # a handle on a forgotten session: back in the table
        if s.state is not SessionState.CLOSED and self._sessions.setdefault(key, s) is not s:
            raise SessionError("this handle's session was forgotten and opened again since")
        if s.state is SessionState.ACTIVE:
            raise SessionError(
                f"session {s.session_id[:64]!r} already has a request running; "
                "requests of one session must be served in order"
            )
        if s.state is SessionState.CLOSED:
            raise SessionError("session is closed; open it again with cache.session()")

    def restore_staged(self, s: Session, ids: Ids) -> KvtierCache | StagedPrefix | None:
        """Restore for a batch whose page pool is the sessions' L1 (`paged_l1`): the longest
        usable prefix of `ids` (never the last token) stays in its L2 slots, pinned, as
        `s.staged` (`kvtier.cache.restore.StagedPrefix`), and no L1 is taken. The batch copies
        it into its pages with `load_staged` and then calls `release_staged`. None: no prefix
        (compute it all); a `KvtierCache`: the session was resident in L1, as `restore`."""
        out = self._restore(s, ids, stage=True)
        return s.staged if out is None else out

    def _restore(self, s: Session, ids: Ids, *, stage: bool) -> KvtierCache | None:
        if not ids:
            raise SessionError("restore needs at least one input token")
        t0 = time.perf_counter()
        with self._lock:
            self._check_restorable(s)
            self._reap(keep=s)
            s.state = SessionState.ACTIVE
            s.last_active = time.time()
            try:
                # leave the last token to compute
                plan = _restore.plan(self, s, ids[:-1], staged=stage)
            except BaseException:
                s.state = SessionState.IDLE if s.resident else SessionState.HIBERNATED
                raise
            if plan is None:
                return self._restored(s, "l1", t0)
            self._restoring += 1
        try:
            _restore.load(self, s, plan)  # reads, throttle and copies: outside the lock
        except BaseException:
            with self._lock:
                self._restoring -= 1
                self._idle.notify_all()
                plan.usable = 0
                _restore.publish(self, s, plan)
                s.state = SessionState.IDLE if s.resident else SessionState.HIBERNATED
            raise
        with self._lock:
            self._restoring -= 1
            self._idle.notify_all()
            source = _restore.publish(self, s, plan, stage=stage)
            if stage:
                self._count_restore(s, source, t0)
                return None
            return self._restored(s, source, t0)

    def load_staged(
        self, s: Session, staged: StagedPrefix, write: Callable[[int, torch.Tensor], None]
    ) -> Handle:
        """Copy a staged prefix (`restore_staged`) from its L2 slots for `write`
        (`TransferEngine.restore_chunks`: one copy per chunk over PCIe, on a side stream on a
        GPU); order the reads after the returned handle, then `release_staged`."""
        if s.staged is not staged:
            raise SessionError("that staged prefix is not the session's (released already?)")
        return self.engine.restore_chunks(staged.slots, staged.tokens, write)

    def release_staged(self, s: Session, staged: StagedPrefix | None = None) -> None:
        """Unpin the session's staged prefix (`staged`, when given: only if it is still that
        one): its chunks may leave L2 again. Call once the copies of `load_staged` are done."""
        with self._lock:
            if staged is None or s.staged is staged:
                self._unstage(s)

    def resume_pages(self, s: Session, ids: Ids, held: int) -> int:
        """Start a turn whose first `held` tokens' K/V a batch's page pool holds (`paged_l1`:
        the pages are the session's L1): nothing is copied. Returns how many leading tokens
        of `ids` (never the last) the turn may take from those pages: the part of `held` that
        the session's stored tokens also cover, so that the commit that follows continues a
        prefix the cache knows. 0: none; the session is then left as it was, for `restore`."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_open()
            if s.state in (SessionState.ACTIVE, SessionState.CLOSED):
                return 0
            self._check_restorable(s)
            want = ids[:-1]
            n = min(held, common_prefix(s.tokens, want))
            if n <= 0 or _restore.tiers_extend(self, s, want, n, whole=True):
                return 0  # L2/L3 hold more of ids (a history edit): a staged restore
            self._release_l1(s)  # the pages hold the same tokens' K/V
            self.truncate(s, n)
            s.in_pages = False
            s.state = SessionState.ACTIVE
            s.last_active = time.time()
            self.counters.hits["l1"] += 1
            self.counters.restored_tokens["l1"] += n
            self._count_restore(s, "l1", t0)
            return n

    def _count_restore(self, s: Session, source: str, t0: float) -> None:
        s.restore_source = source
        self.counters.decisions[source] += 1
        self._record_latency(source, time.perf_counter() - t0)

    def _restored(self, s: Session, source: str, t0: float) -> KvtierCache:
        self._count_restore(s, source, t0)
        return KvtierCache(s)  # type: ignore[arg-type]  # resident: bufs is set

    def prefetch_session(self, s: Session) -> None:
        with self._lock:
            _restore.prefetch(self, s)

    def grow_session(self, s: Session, tokens: int) -> None:
        """More L1 room during a forward (evicts idle sessions under the lock if needed)."""
        assert s.bufs is not None
        bufs = s.bufs
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        keep = max(s.lengths) if s.lengths else 0  # layers already written in this forward
        if tokens > bufs.capacity and bufs.copy is not None:
            # The old block leaves L1's budget once the new one holds its tokens: counted in
            # flight from now until its copy down is done (waited for at the bound).
            self.engine.inflight.retire(bufs.copy, bufs.nbytes)
        old_layers = bufs.layers
        self._with_room(need, lambda: self.l1.grow(bufs, tokens, keep), exclude=s)
        if bufs.layers is not old_layers:
            bufs.copy = None  # no copy has read the new block yet

    def chunk_counts(self, keys: list[bytes]) -> tuple[int, int]:
        """(chunks in L2, chunks in L3) among `keys` (for `Session.info`)."""
        with self._lock:
            return self.directory.count(keys)

    def key_for(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes:
        """Key of a full chunk: the shared namespace's if that prefix was published."""
        return self.keyed(parent, toks, s)[0]

    def keyed(self, parent: bytes, toks: Sequence[int], s: Session) -> tuple[bytes, bool]:
        """`key_for`, and whether the key is the shared namespace's. A shared key is looked for
        only where one can exist: something was published into this store (`_published`, also
        set from L3 at start), or another host's may be in L4. Otherwise the session's own key
        is the only one, and one hash instead of two (a restore hashes every chunk)."""
        if self._published or self.l4 is not None:
            shared = chunk_key(parent, toks, self._shared_ns)
            d = self.directory
            if d.get(shared) is not None or (self._published and d.in_l3(shared)):
                return shared, True
            if self.l4 is not None and shared in self.l4.known:  # published on another host
                return shared, True
        return chunk_key(parent, toks, s.ns), False

    @functools.cached_property
    def _shared_ns(self) -> bytes:
        return namespace(self.fingerprint, SHARED_TENANT)

    def _header(self, entry: Chunk) -> ChunkHeader:
        return self.codec.header(
            entry.key,
            entry.tokens,
            fingerprint=self.fingerprint,
            tenant=entry.tenant,
            parent=entry.parent,
        )

    def _reap(self, keep: Session | None = None) -> None:
        """Harvest finished writes, L3 evictions and expired sessions; queue shed L3 writes
        again; forget idle sessions past the bounds; reclaim dead entries."""
        self.directory.reap_writes()
        if self.directory.unwritten:
            self.directory.retry_unwritten()
        now = time.time()
        self._sessions.forget_due(now, keep)
        for s in list(self._sessions.values()):
            if (
                s is not keep
                and s.ttl_s is not None
                and s.state is not SessionState.ACTIVE
                and now - s.last_active > s.ttl_s
            ):
                self.close_session(s)
        self.directory.sweep(self._live_keys)

    def _live_keys(self) -> set[bytes]:
        live: set[bytes] = set()
        for s in self._sessions.values():
            live.update(s.chunk_keys)
            if s.tail_key is not None:
                live.add(s.tail_key)
        return live

    # -- L1 admission and eviction (the only places that allocate L1) --------------------------

    def alloc_l1(self, s: Session, tokens: int) -> None:
        if s.bufs is not None:
            self.grow_session(s, tokens)
            return
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        s.bufs = self._with_room(need, lambda: self.l1.allocate(tokens), exclude=s)
        s.lengths = [0] * self.geometry.num_layers

    def _release_l1(self, s: Session) -> None:
        """Free the session's L1. A copy down still reading it keeps its bytes counted, in
        flight (`TransferEngine.inflight`), until it is done: at the bound this waits."""
        if s.bufs is not None:
            self.engine.inflight.retire(s.bufs.copy, s.bufs.nbytes)
            self.l1.release(s.bufs)
            s.bufs, s.lengths = None, []

    def _with_room(self, need: int, alloc: Any, exclude: Session) -> Any:
        """Run `alloc`, evicting idle sessions (unpinned first, LRU) while L1 is short."""
        with self._lock:
            while True:
                try:
                    if self.l1.free_bytes >= need:
                        return alloc()
                except torch.cuda.OutOfMemoryError:
                    self.counters.oom_retries += 1
                    if not self._evict_one(exclude):
                        raise L1BudgetExceeded(
                            "the GPU ran out of memory for L1 and no idle session is left to "
                            "evict; lower l1_bytes or the concurrency"
                        ) from None
                    torch.cuda.empty_cache()
                    continue
                except L1BudgetExceeded:
                    pass
                if not self._evict_one(exclude):
                    raise L1BudgetExceeded(
                        f"L1 budget of {self.l1.budget_bytes} bytes cannot hold {need} more bytes "
                        "even after evicting every idle session; raise l1_bytes or lower the "
                        "number of concurrent requests"
                    )

    def _evict_one(self, exclude: Session) -> bool:
        candidates = [
            s
            for s in self._sessions.values()
            if s.resident and s is not exclude and s.state is not SessionState.ACTIVE
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: (s.pinned, s.last_active))
        self.hibernate_session(victim, wait=False)
        self.counters.evictions["l1"] += 1
        return True

    # -- stats ------------------------------------------------------------------------------------

    def truncate(self, s: Session, n: int) -> None:
        """Keep the first `n` of the session's tokens. Its stored partial tail stays its own
        when nothing is cut (a turn that then fails still restores it)."""
        if n < len(s.tokens):
            s.tail_key = None
        s.tokens = s.tokens[:n]
        s.lengths[:] = [n] * len(s.lengths)
        del s.chunk_keys[n // self.chunk_tokens :]
        s.flushed = min(s.flushed, len(s.chunk_keys))

    def _record_latency(self, src: str, seconds: float) -> None:
        counts = self.counters.latency[src]
        for i, bound in enumerate(RESTORE_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self.counters.latency_sum[src] += seconds
        self.counters.latency_count[src] += 1

    def device_bytes(self) -> dict[str, int]:
        """The most device memory kvtier holds, by part, in bytes (for a server's GPU memory
        plan): 'l1' the L1 pool's budget (claimed whole at start on a GPU), 'staging' the
        transfer engine's staging buffers, 'inflight_max' the bound of copies in flight
        (`CacheConfig.inflight_bytes_max`: L1 blocks released while their chunks still go
        down, chunks gathered from pages). kvtier never holds more than their sum; on a GPU
        `l1_bytes` is 'l1' + 'staging', and 'inflight_max' comes on top of it."""
        return {
            "l1": self.l1.budget_bytes,
            "staging": self.engine.staging_bytes,
            "inflight_max": self.engine.inflight.max_bytes,
        }

    def inflight_bytes(self) -> int:
        """Device bytes copies in flight hold now, at most `device_bytes()['inflight_max']`
        (besides them kvtier holds `l1.used_bytes` of L1 and the staging buffers)."""
        return self.engine.inflight_bytes()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the cost model a prefill timed outside a session's Cache (a batched forward of
        `tokens` prompt tokens that took `seconds`): restores weigh loading against that."""
        with self._lock:
            self.cost.observe_prefill(tokens, seconds)

    def stats(self) -> CacheSnapshot:
        """A frozen snapshot of every tier, session and counter. Never waits for I/O: the
        numbers are copied under the lock; the store and the engine are asked outside it."""
        with self._lock:
            self._reap()
            C = self.chunk_tokens
            inputs = SnapshotInputs(
                counters=self.counters.copy(),
                l1_budget=self.l1.budget_bytes,
                l1_used=self.l1.used_bytes,
                l1_chunks=sum(
                    -(-len(s.tokens) // C) for s in self._sessions.values() if s.resident
                ),
                l2_slots=self.l2.n_slots,
                l2_free=self.l2.free_slots,
                l2_slot_bytes=self.l2.slot_bytes,
                sessions=tuple(s.info() for s in self._sessions.values()),
                l4_chunks=len(self.l4.known) if self.l4 is not None else 0,
            )
        l4 = self.l4.stats() if self.l4 is not None else None
        return build_snapshot(inputs, self.l3.stats(), self.engine.stats(), l4)


def _check_tenant(tenant: str) -> None:
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


__all__ = ["Session", "TieredCache"]
