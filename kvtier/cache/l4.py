"""SharedTier: a TieredCache's side of L4 (the shared Redis tier, kvtier.tiers.l4).

- Which chunks L4 is believed to hold (`known`, key -> tokens): the keys of session records
  read from L4 and of chunks this process wrote there. `SharedTier` is the cache's cold tier
  L4 (kvtier.cache.coldtier), asked after L2 and L3; a chunk that Redis evicted or let expire
  is a miss there.
- Restores: the L4 chunks of a plan get L2 slots like L3 reads do, and one `get_chunks` call
  fetches them all (pipelined, several connections); each payload is verified and copied into
  its slot on the L4 read threads, then the restore copies L2 -> L1 as for any other chunk.
  Each value's header must describe the chunk the restore asked for (the entry's key and
  tokens, the cache's fingerprint, geometry and codec, the tenant) before a byte of it lands:
  anything else is deleted from Redis, counted and recomputed, never padded out with what an
  earlier chunk left in the slot.
- Write-behind: a hibernated session is queued (bounded in chunks; a job that does not fit is
  shed and counted) and written by one thread after `l4_min_idle_s`, if it is still hibernated
  then (in memory, or forgotten from memory since with its saved record unchanged: pending or
  in L3): chunks Redis lacks are read back from L3 (verified) or from an idle L2 slot and put;
  the session record is put last, so a record never names a chunk that was not written.
  Closing a session drops its queued writes.
- Health: a thread pings Redis every `l4_health_s` (the half-open probe of an open breaker);
  the round trip feeds the cost model's L4 latency, and a new Redis `run_id` (a restart that
  lost its data) queues every hibernated session again, those forgotten from memory too (read
  from L3's index a page at a time): nothing L3 holds is lost for good.

- Encryption: with an encrypted L3 store every chunk and session record put in L4 is sealed
  under the tenant's data key as L3 seals it, and opened on every read (kvtier.tiers.l4.sealed);
  `shred` deletes the tenant's keys, records and chunks from Redis too.

No method here raises to a restore or a session lookup: Redis trouble is a miss.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.cache.keys import SHARED_TENANT
from kvtier.errors import ChunkNotFound, FingerprintMismatch, KvbinFormatError, StoreError
from kvtier.kvbin import ChunkHeader
from kvtier.sealing import load_master_key
from kvtier.tiers.l3 import SessionRecord
from kvtier.tiers.l4 import Breaker, L4Store, ReadBatch
from kvtier.tiers.l4.sealed import TenantKeys
from kvtier.types import SessionState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.records import SessionRecords
    from kvtier.cache.restoreplan import TierReads
    from kvtier.cache.session import Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters
    from kvtier.tiers.l2 import HostArena
    from kvtier.tiers.l3 import L3Store
    from kvtier.transfer import TransferEngine

log = logging.getLogger("kvtier.cache")
KNOWN_MAX = 1 << 20  # chunk keys remembered as L4 candidates (about 100 MB at most)


@dataclass
class _Job:
    record: SessionRecord
    chunks: list[tuple[bytes, int]]  # key, tokens
    not_before: float
    delete: bool = False  # drop the session's record instead


@dataclass
class PendingReads:
    """The L4 reads of one restore plan, launched together once the plan has its slots."""

    keys: list[bytes]
    slots: list[int]
    futures: list[Future[Any]]
    batch: ReadBatch | None = None
    expect: list[ChunkHeader] = field(default_factory=list)  # what each value must say


class SharedTier:
    """L4 as the cache's cold tier (`kvtier.cache.coldtier.ColdTier`), and its write-behind,
    lookups and health."""

    tier = Tier.L4.value

    def __init__(
        self,
        *,
        identity: CacheIdentity,
        guard: CacheGuard,
        directory: ChunkDirectory,
        table: SessionTable,
        records: SessionRecords,
        cost: CostModel,
        counters: Counters,
        l2: HostArena,
        l3: L3Store,
        engine: TransferEngine,
    ) -> None:
        cfg = identity.config
        assert cfg.l4_url is not None
        self.identity = identity
        self.guard = guard
        self.directory = directory
        self.table = table
        self.records = records
        self.cost = cost
        self.counters = counters
        self.l2 = l2
        self.l3 = l3
        self.engine = engine
        self.store = L4Store(
            cfg.l4_url,
            ttl_s=cfg.l4_ttl_s,
            timeout_s=cfg.l4_timeout_s,
            streams=cfg.l4_read_streams,
            breaker=Breaker(backoff_s=cfg.l4_backoff_s),
        )
        keyring = l3.keyring
        if keyring is not None and not keyring.locked and cfg.master_key_file is not None:
            master = load_master_key(cfg.master_key_file)
            self.store.sealer = TenantKeys(self.store, keyring, master)
        # key -> tokens of chunks believed in L4 (oldest forgotten first past KNOWN_MAX);
        # written by the cache's threads and the L4 threads: single dict operations only
        self.known: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.min_idle_s = cfg.l4_min_idle_s
        self.queue_max = cfg.l4_write_queue
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued = 0  # chunks in queued jobs
        self._active: _Job | None = None  # the job being written
        self._cv = threading.Condition()
        self._stop = False
        self._closing = False
        self._buf: Any = None
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-l4w", daemon=True)
        self._health = threading.Thread(target=self._health_loop, name="kvtier-l4h", daemon=True)
        self._health_s = cfg.l4_health_s
        self._writer.start()
        self._health.start()

    # -- sessions --------------------------------------------------------------------------------

    def lookup(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The session's record in L4 (outside the cache's lock); None on a miss or trouble."""
        t0 = time.perf_counter()
        try:
            rec = self.store.get_record(self.identity.fingerprint, tenant, session_id)
        except StoreError as exc:
            log.info("L4 session lookup skipped: %s", exc)
            return None
        self._observe_latency(time.perf_counter() - t0)
        if rec is not None:
            self.note_record(rec)
        return rec

    def note_record(self, rec: SessionRecord) -> None:
        C = self.identity.chunk_tokens
        n_tokens = len(rec.token_ids) // 4
        for i, key in enumerate(rec.chunk_keys):
            self.remember(key, min(C, n_tokens - i * C))

    def remember(self, key: bytes, tokens: int) -> None:
        self.known[key] = tokens
        while len(self.known) > KNOWN_MAX:
            try:
                self.known.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break

    def forget_session(self, s: Session) -> None:
        """A closed session: its record leaves L4 too, through the write queue (after a write
        of it being written; never shed). Its writes still queued are dropped: one of a session
        forgotten from memory would find its record in L3 until the delete lands there."""
        rec = SessionRecord(s.session_id, s.tenant, self.identity.fingerprint, b"", (), False,
                            None, 0.0, "closed")  # fmt: skip
        with self._cv:
            if self._stop:
                return
            for job in [j for j in self._jobs if _same_session(j.record, rec)]:
                self._jobs.remove(job)
                self._queued -= len(job.chunks)
            self._jobs.append(_Job(rec, [], time.monotonic(), delete=True))
            self._cv.notify_all()

    # -- the cold tier: restores (under the cache's lock, except the read threads) -------------

    def holds(self, key: bytes) -> int | None:
        """Believed in L4 (while Redis is reachable): a key read or written here."""
        return self.known.get(key) if self.store.up else None

    def start_read(self, e: Chunk, reads: TierReads) -> Future[Any] | None:
        """Reserve `e`'s L2 slot and register its read in the restore's batch (`launch`
        sends the batch)."""
        p = reads.own
        if p is None:
            p = reads.own = PendingReads([], [], [])
        key = e.key

        def fetch(slot: int) -> Future[Any]:
            fut: Future[Any] = Future()
            p.keys.append(key)
            p.slots.append(slot)
            p.futures.append(fut)
            p.expect.append(self._expected(key))
            return fut

        return self.directory.start_fetch(e, fetch, self)

    def write(self, e: Chunk) -> None:
        """Nothing per chunk: L4 is written behind, a hibernated session at a time
        (`enqueue`), chunks first and its record last."""

    def observe(self, reads: TierReads, nbytes: int, t_read: float, t_copy: float) -> None:
        """Count the failed reads as misses (evicted, expired, damaged or unreachable), and feed
        the cost model with the usable bytes and the batch's time plus their copy's share."""
        self.counters.misses[self.tier] += reads.failed
        p = reads.own
        if p is None or p.batch is None or nbytes <= 0 or not p.batch.finished:
            return
        self.cost.observe_load(self.tier, nbytes, p.batch.seconds + t_copy)

    def _expected(self, key: bytes, tokens: int | None = None) -> ChunkHeader:
        """The header a value of chunk `key` must have: as the cache writes its directory
        entry; given `tokens` (the write-behind, off the lock), that many, whatever tenant."""
        ident = self.identity
        if tokens is None:  # a restore's read, under the cache's lock: the entry is there
            e = self.directory.get(key)
            if e is not None:
                return ident.header(e)
            tokens = 0  # no value matches: a miss
        return ident.codec.header(key, tokens, fingerprint=ident.fingerprint, tenant="")

    def launch(self, reads: TierReads, tenant: str) -> None:
        """Start the restore's L4 reads (one pipelined, multi-stream `get_chunks`)."""
        p = reads.own
        if p is None or not p.keys:
            return
        arena = self.l2
        slots = p.slots

        def dest(i: int, header: ChunkHeader) -> memoryview:
            view = memoryview(arena.buffer(slots[i])).cast("B")
            if header.payload_len > len(view):
                raise KvbinFormatError(f"L4 chunk {header.key.hex()} does not fit an L2 slot")
            return view

        p.batch = self.store.get_chunks(
            p.keys,
            self.identity.fingerprint,
            dest,
            tenants=(tenant, SHARED_TENANT),
            expect=p.expect,
        )
        for key, src, dst in zip(p.keys, p.batch.futures, p.futures, strict=True):
            src.add_done_callback(self._settler(key, dst))

    def _settler(self, key: bytes, dst: Future[Any]) -> Any:
        return lambda src: self._settle(key, src, dst)

    def _settle(self, key: bytes, src: Future[Any], dst: Future[Any]) -> None:
        exc = src.exception()
        if exc is None:
            dst.set_result(src.result())
            return
        if isinstance(exc, (ChunkNotFound, KvbinFormatError, FingerprintMismatch)):
            self.known.pop(key, None)  # evicted, expired or damaged: not asked for again
        dst.set_exception(exc)

    def _observe_latency(self, seconds: float) -> None:
        with self.guard:
            self.cost.observe_latency(self.tier, seconds)

    # -- write-behind ----------------------------------------------------------------------------

    def enqueue(self, s: Session, rec: SessionRecord) -> None:
        """Queue the hibernated session for L4 (under the cache's lock); shed when full."""
        self._enqueue(rec)

    def _enqueue(self, rec: SessionRecord) -> bool:
        """Queue the record's session (under the cache's lock); False if shed or closing."""
        d = self.directory
        chunks = []
        for key in rec.chunk_keys:
            e = d.get(key)
            tokens = e.tokens if e is not None else d.l3_tokens.get(key, 0)
            # 0: no tier here holds it (a session found in L4): the writer checks L4 has it
            chunks.append((key, tokens))
        with self._cv:
            if self._stop or self._closing:
                return False
            # the queue holds keys, not bytes: one session longer than the bound still goes
            # when nothing else waits, else long contexts would never reach L4
            if self._queued and self._queued + len(chunks) > self.queue_max:
                self.store.count("writes_shed", max(1, len(chunks)))
                return False
            self._jobs.append(_Job(rec, chunks, time.monotonic() + self.min_idle_s))
            self._queued += len(chunks)
            self._cv.notify_all()
        return True

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write-behind has been handled (written, skipped or given
        up); False on timeout. Jobs still inside `l4_min_idle_s` are waited for too."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queued or self._jobs or self._active is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def shred(self, tenant: str, chunk_keys: set[bytes], session_ids: set[str]) -> None:
        """The tenant's crypto-shred reaches L4 (best effort; call outside the cache's lock):
        its queued writes are dropped, one being written is waited for, then its data keys,
        records and the chunks named leave Redis. Whatever stays (Redis down, or chunks only
        another host knows) is sealed under keys nobody can find any more: a miss."""
        deadline = time.monotonic() + 30.0
        with self._cv:
            for job in [j for j in self._jobs if j.record.tenant == tenant]:
                self._jobs.remove(job)
                self._queued -= len(job.chunks)
            while self._active is not None and self._active.record.tenant == tenant:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            self._cv.notify_all()
        for key in chunk_keys:
            self.known.pop(key, None)
        if self.store.sealer is not None:
            self.store.sealer.forget(tenant)
        try:
            n = self.store.shred_tenant(tenant, self.identity.fingerprint, chunk_keys, session_ids)
        except StoreError as exc:
            log.warning("L4 shred of tenant %r skipped (%s): its wrapped data keys, records "
                        "and chunks stay in Redis until their TTL; shred the tenant again once "
                        "Redis is back", tenant[:64], exc)  # fmt: skip
            return
        log.info("L4 shred of tenant %r: %d keys deleted", tenant[:64], n)

    def requeue_all(self) -> None:
        """Redis restarted (new run_id): write every hibernated session again, those in memory
        and those forgotten from it (`_requeue_stored`)."""
        if self.store.sealer is not None:
            self.store.sealer.republish()
        if not self._lock_cache():
            return  # closing
        try:
            for s in list(self.table.values()):
                if s.state is SessionState.HIBERNATED:
                    self.enqueue(s, self.records.record(s))
            stored = self.table.partial  # some sessions are in L3 alone
        finally:
            self.guard.release()
        if stored:
            try:
                self._requeue_stored()
            except Exception as exc:  # the health thread never goes down (L3 closing, say)
                log.warning("L4: sessions forgotten from memory not written again: %s", exc)

    def _requeue_stored(self, page: int = 256) -> None:
        """Queue the sessions whose records only L3 holds (forgotten from memory, or left there
        by an earlier process): L3's index a page of records at a time, read outside the
        cache's lock; stops at the first one shed (the queue is full)."""
        l3, table = self.l3, self.table
        after = 0
        while rows := l3.index.session_keys(self.identity.fingerprint, after, page):
            after = rows[-1][0]
            # a record on its way to L3 is newer than the one there (sessiontable)
            recs = [table.pending((t, sid)) or l3.load_session(sid, t)
                    for _, sid, t in rows]  # fmt: skip
            if not self._lock_cache():
                return  # closing
            try:
                for rec in recs:
                    if rec is None or rec.key_id is not None:
                        continue  # closed since, or sealed under a key this process lacks
                    if (rec.tenant, rec.session_id) in table:
                        continue  # in memory: queued above if hibernated
                    if not self._enqueue(rec):
                        log.warning("L4 write queue full: sessions forgotten from memory past "
                                    "%r are not written again", rec.session_id[:64])  # fmt: skip
                        return
            finally:
                self.guard.release()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop and (not self._closing or not self._jobs):
                    return
                # the first job due (a record delete is due at once; writes wait out
                # l4_min_idle_s in the order they came); closing, every job is due
                now = time.monotonic()
                job = next((j for j in self._jobs if j.not_before <= now), self._jobs[0])
                wait = job.not_before - now
                if wait > 0 and not self._closing:
                    self._cv.wait(wait)
                    continue
                self._jobs.remove(job)
                self._active = job
            try:
                self._write_job(job)
            except Exception as exc:  # a background write never takes the thread down
                log.warning("L4 write-behind of a session failed: %s", exc)
            finally:
                with self._cv:
                    self._queued -= len(job.chunks)
                    self._active = None
                    self._cv.notify_all()

    def _to_publish(self, rec: SessionRecord) -> SessionRecord | None:
        """The record to put for a queued write of `rec` if the session is still hibernated
        as `rec` saw it: in memory, or forgotten from memory since (then its saved record,
        pending or in L3, with what it may have changed since: pinned, TTL). None if it was
        restored again (its next hibernate queues it anew) or closed."""
        if not self._lock_cache():
            return rec  # closing: every session is hibernated now
        key = (rec.tenant, rec.session_id)
        try:
            s = self.table.get(key)
            if s is not None:
                same = s.state is SessionState.HIBERNATED and s.last_active == rec.last_active
                return rec if same else None
            saved = self.table.pending(key)  # forgotten, its save not landed yet
        finally:
            self.guard.release()
        if saved is None:  # outside the lock: an SQLite read (None: closed)
            saved = self.l3.load_session(rec.session_id, rec.tenant)
        if saved is None or saved.key_id is not None or not _same_session(saved, rec):
            return None
        same = (saved.last_active, saved.chunk_keys) == (rec.last_active, rec.chunk_keys)
        return saved if same and bytes(saved.token_ids) == bytes(rec.token_ids) else None

    def _lock_cache(self) -> bool:
        """Take the cache's lock, unless the cache is closing (close holds it while it waits
        for this thread)."""
        while not self._closing:
            if self.guard.acquire(timeout=0.05):
                return True
        return False

    def _write_job(self, job: _Job) -> None:
        rec = job.record
        if job.delete:
            try:
                self.store.delete_record(rec.fingerprint, rec.tenant, rec.session_id)
            except StoreError as exc:
                log.info("L4 record delete skipped: %s", exc)
            return
        publish = self._to_publish(rec)
        if publish is None:
            return  # restored again or closed meanwhile
        try:
            have = self.store.exists([k for k, _ in job.chunks])
            for (key, tokens), present in zip(job.chunks, have, strict=True):
                if not present and not (tokens and self._put_chunk(key, tokens)):
                    return  # the record is not published without its chunks
                if tokens:
                    self.remember(key, tokens)
            self.store.put_record(publish)
        except StoreError as exc:
            log.info("L4 write-behind of session %r stopped: %s", rec.session_id[:64], exc)

    def _put_chunk(self, key: bytes, tokens: int) -> bool:
        """Put one chunk of `tokens` tokens from an idle L2 copy (pinned meanwhile), else from
        L3 (verified, its header too: a forged file is not spread to other hosts); False if
        neither holds it any more."""
        d = self.directory
        pinned: Chunk | None = None
        write: Future[Any] | None = None
        if self._lock_cache():
            try:
                d.reap_writes()
                e = d.get(key)
                if e is not None and e.l3_write is not None:
                    write = e.l3_write
                elif (
                    e is not None
                    and e.tenant  # known for chunks written from L1 (else L3's header says)
                    and e.l2_slot is not None
                    and e.l3_read is None
                    and not self.engine.busy(e.l2_slot)
                ):
                    d.pin([e])  # nobody frees or reuses the slot while it is read
                    pinned = e
            finally:
                self.guard.release()
        if write is not None:
            write.exception()  # the L3 write lands first; the chunk is read back from there
        if pinned is not None:
            try:
                header = self.identity.header(pinned)
                assert pinned.l2_slot is not None
                view = memoryview(self.l2.buffer(pinned.l2_slot)).cast("B")
                self.store.put_chunk(header, view[: header.payload_len])
            finally:
                locked = self._lock_cache()
                d.unpin([pinned])  # unlocked only while the cache closes (it waits for us)
                if locked:
                    self.guard.release()
            return True
        if self._buf is None:
            self._buf = self.l3.aligned_buffer(self.l2.slot_bytes + 4096)
        try:
            expect = self._expected(key, tokens)
            fp = self.identity.fingerprint
            header = self.l3.get(key, self._buf, fingerprint=fp, expect=expect)
        except StoreError as exc:
            log.info("L4 write-behind: chunk %s not readable from L3 (%s)", key.hex(), exc)
            return False
        self.store.put_chunk(header, self._buf[: header.payload_len])
        return True

    # -- health ----------------------------------------------------------------------------------

    def _health_loop(self) -> None:
        last_run: str | None = None
        while True:
            with self._cv:
                if self._stop:
                    return
            b = self.store.breaker
            if b.state == "closed" or b.probe_due():
                try:
                    rtt = self.store.ping()
                except StoreError:
                    pass
                else:
                    if self._lock_cache():
                        try:
                            self.cost.observe_latency(self.tier, rtt)
                        finally:
                            self.guard.release()
                    run = self.store.run_id
                    if last_run is not None and run != last_run:
                        log.warning("L4 Redis restarted (run_id changed); writing sessions again")
                        self.known.clear()
                        self.requeue_all()
                    last_run = run
            with self._cv:
                if self._stop:
                    return
                self._cv.wait(self._health_s)

    # -- stats, lifetime -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """`L4Store.stats()` plus Redis's memory as last pinged (build_snapshot takes it)."""
        return {**self.store.stats(), "memory": dict(self.store.memory)}

    def close(self, drain_s: float = 30.0) -> None:
        """Finish the queued writes (reading L3 only: the cache is closing), then stop."""
        with self._cv:
            self._closing = True
            self._stop = True
            self._cv.notify_all()
        self._writer.join(drain_s)
        self._health.join(drain_s)
        self.store.close()


def _same_session(a: SessionRecord, b: SessionRecord) -> bool:
    return (a.tenant, a.session_id, bytes(a.fingerprint)) == (
        b.tenant,
        b.session_id,
        bytes(b.fingerprint),
    )
