"""Restorer: a returning turn's prefix back from the tiers, in three phases so that the cache's
guard is never held across I/O.

1. plan (guard held): find the longest cached prefix (`ChunkCatalog`), let the cost model cut
   it, pin every chunk of it (nobody frees or reuses a pinned chunk's L2 slot), make room in L1
   (`L1Room`), reserve L2 slots for the L3 chunks and start their reads.
2. load (no lock): wait for the L3 reads, sleep out the read throttle, copy the usable prefix
   L2 -> L1 and wait for that copy.
3. publish (guard held): settle the reads (a chunk that failed to read is forgotten, its slot
   freed), unpin, and set the session's tokens and keys.

A *staged* restore (`restore_staged`, for a batch whose page pool is the sessions' L1) stops
short of L1: it takes no L1 room and copies nothing in phase 2, and phase 3 keeps the usable
prefix's chunks pinned as a `StagedPrefix`. The batch copies them from their L2 slots straight
into its pages when it admits the turn (`load_staged`, one copy per chunk over PCIe) and then
lets them go (`release_staged`).

A session is ACTIVE from phase 1 to its commit, so no one evicts or restores it meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key
from kvtier.cache.restoreplan import DEPTH, RestorePlan, StagedPrefix, common_prefix
from kvtier.errors import SessionError
from kvtier.integrations.hf import KvtierCache
from kvtier.snapshot import RESTORE_BUCKETS
from kvtier.types import RestoreSource, SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.catalog import ChunkCatalog
    from kvtier.cache.config import CacheConfig
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l1room import L1Room
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.lifecycle import SessionLifecycle
    from kvtier.cache.session import Ids, Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters
    from kvtier.transfer import TransferEngine
    from kvtier.transfer.staging import Handle

__all__ = ["RestorePlan", "Restorer", "StagedPrefix", "common_prefix"]

log = logging.getLogger("kvtier.cache")


@dataclass(eq=False, kw_only=True)
class Restorer:
    guard: CacheGuard
    identity: CacheIdentity
    directory: ChunkDirectory
    counters: Counters
    cost: CostModel
    engine: TransferEngine
    l4: SharedTier | None
    table: SessionTable
    catalog: ChunkCatalog
    room: L1Room
    lifecycle: SessionLifecycle

    @property
    def config(self) -> CacheConfig:
        return self.identity.config

    # -- entry points ------------------------------------------------------------------------------

    def restore_session(self, s: Session, ids: Ids) -> KvtierCache:
        cache = self.restore(s, ids, stage=False)
        assert isinstance(cache, KvtierCache)
        return cache

    def restore_staged(self, s: Session, ids: Ids) -> KvtierCache | StagedPrefix | None:
        """See `TieredCache.restore_staged`."""
        out = self.restore(s, ids, stage=True)
        return s.staged if out is None else out

    def check_restorable(self, s: Session) -> None:
        """(guard held) The session may start a turn: open, its handle current, not running."""
        self.guard.check_open()
        key = (s.tenant, s.session_id)  # a handle on a forgotten session: back in the table
        if s.state is not SessionState.CLOSED and self.table.setdefault(key, s) is not s:
            raise SessionError("this handle's session was forgotten and opened again since")
        if s.state is SessionState.ACTIVE:
            raise SessionError(
                f"session {s.session_id[:64]!r} already has a request running; "
                "requests of one session must be served in order"
            )
        if s.state is SessionState.CLOSED:
            raise SessionError("session is closed; open it again with cache.session()")

    def restore(self, s: Session, ids: Ids, *, stage: bool) -> KvtierCache | None:
        if not ids:
            raise SessionError("restore needs at least one input token")
        t0 = time.perf_counter()
        with self.guard:
            self.check_restorable(s)
            self.lifecycle.reap(keep=s)
            s.begin_turn()
            try:
                # leave the last token to compute
                plan = self._plan(s, ids[:-1], staged=stage)
            except BaseException:
                s.abort_turn()
                raise
            if plan is None:
                return self._restored(s, "l1", t0)
            self.guard.begin_load()
        try:
            self._load(s, plan)  # reads, throttle and copies: outside the lock
        except BaseException:
            with self.guard:
                self.guard.end_load()
                plan.usable = 0
                self._publish(s, plan)
                s.abort_turn()
            raise
        with self.guard:
            self.guard.end_load()
            source = self._publish(s, plan, stage=stage)
            if stage:
                self.count(s, source, t0)
                return None
            return self._restored(s, source, t0)

    def load_staged(
        self, s: Session, staged: StagedPrefix, write: Callable[[int, torch.Tensor], None]
    ) -> Handle:
        """See `TieredCache.load_staged`."""
        if s.staged is not staged:
            raise SessionError("that staged prefix is not the session's (released already?)")
        return self.engine.restore_chunks(staged.slots, staged.tokens, write)

    def release_staged(self, s: Session, staged: StagedPrefix | None = None) -> None:
        """See `TieredCache.release_staged`."""
        with self.guard:
            if staged is None or s.staged is staged:
                self.lifecycle.unstage(s)

    def resume_pages(self, s: Session, ids: Ids, held: int) -> int:
        """See `TieredCache.resume_pages`."""
        t0 = time.perf_counter()
        with self.guard:
            self.guard.check_open()
            if s.state in (SessionState.ACTIVE, SessionState.CLOSED):
                return 0
            self.check_restorable(s)
            want = ids[:-1]
            n = min(held, common_prefix(s.tokens, want))
            if n <= 0 or self.catalog.tiers_extend(s, want, n, whole=True):
                return 0  # L2/L3 hold more of ids (a history edit): a staged restore
            self.room.release(s)  # the pages hold the same tokens' K/V
            s.truncate(n)
            s.in_pages = False
            s.begin_turn()
            self.counters.hits["l1"] += 1
            self.counters.restored_tokens["l1"] += n
            self.count(s, "l1", t0)
            return n

    def reload(self, s: Session, ids: Ids) -> KvtierCache:
        """A session with a request running whose L1 was dropped (an L1 move off a lost
        device): restore the longest stored prefix of `ids` into the new L1."""
        with self.guard:
            if s.state is not SessionState.ACTIVE or s.bufs is not None:
                raise SessionError(
                    f"session {s.session_id[:64]!r} still has its L1 (or no request running); "
                    "reload is only for a running request whose L1 device was lost"
                )
            s.hibernated()
        return self.restore_session(s, ids)

    def count(self, s: Session, source: str, t0: float) -> None:
        """(guard held) Count a restore from `source` that began at `t0`."""
        s.restore_source = source
        self.counters.decisions[source] += 1
        seconds = time.perf_counter() - t0
        counts = self.counters.latency[source]
        for i, bound in enumerate(RESTORE_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self.counters.latency_sum[source] += seconds
        self.counters.latency_count[source] += 1

    def _restored(self, s: Session, source: str, t0: float) -> KvtierCache:
        self.count(s, source, t0)
        return KvtierCache(s)  # type: ignore[arg-type]  # resident: bufs is set

    # -- the three phases --------------------------------------------------------------------------

    def _plan(self, s: Session, want: Ids, staged: bool = False) -> RestorePlan | None:
        """Phase 1 (guard held). None: served from L1, nothing to load. L1 gets room for the
        whole of `want` and the token after it, where the forward will write them; `staged`:
        none (the prefix stays in L2, see `StagedPrefix`). Where L2/L3 hold more of `want` than
        L1 (`tiers_extend`), L1 keeps its full chunks in common with `want` (none when staged)
        and the chunks after them are loaded."""
        C = self.identity.chunk_tokens
        n = self.counters
        catalog = self.catalog
        s.in_pages = False  # a batch's pages of it, if any, are not what this turn starts from
        base = 0
        if s.resident:
            common = common_prefix(s.tokens, want)
            if catalog.tiers_extend(s, want, common, whole=staged):
                base = 0 if staged else common // C * C
                n.hits["l1"] += base > 0
                n.restored_tokens["l1"] += base
            elif common > 0:
                s.truncate(common)
                n.hits["l1"] += 1
                n.restored_tokens["l1"] += common
                return None
            s.truncate(base)
        n.misses["l1"] += 1
        segments: list[tuple[str, Chunk]] = []
        parent = s.chunk_keys[-1] if base else ZERO_KEY
        tail = len(s.tokens) % C if s.tail_key is not None else 0
        for i in range(base // C, len(want) // C + 1):
            toks = want[i * C : (i + 1) * C]
            entry: Chunk | None = None
            src = ""
            if len(toks) == C:
                key, shared = catalog.keyed(parent, toks, s)
                entry, src = catalog.locate(key, parent)
                if entry is not None and not entry.tenant:  # found in L3: whose is it (shred)?
                    entry.tenant = SHARED_TENANT if shared else s.tenant
            if (
                entry is None
                and tail
                and len(toks) >= tail
                and chunk_key(parent, toks[:tail], s.ns) == s.tail_key
            ):
                # the session's own hibernated partial tail, at the end of its stored prefix
                entry, src = catalog.locate(s.tail_key, parent)
                if entry is not None and not entry.tenant:
                    entry.tenant = s.tenant
            if entry is None:
                n.misses["l3"] += 1
                if self.l4 is not None:
                    n.misses["l4"] += 1
                break
            segments.append((src, entry))
            parent = entry.key
            if entry.tokens < C:
                break
        if self.config.cost_model:
            payload = self.identity.codec.payload_bytes
            keep = self.cost.plan([(src, payload(e.tokens), e.tokens) for src, e in segments])
            segments = segments[:keep]
        p = RestorePlan(want, segments, base=base)
        self.directory.pin(e for _, e in segments)
        l4 = self.l4
        try:
            loaded = sum(e.tokens for _, e in segments)
            if not staged:
                self.room.alloc(s, max(len(want) + 1, base + loaded))
            s.tokens, s.tail_key = s.tokens[:base], None  # L1 keeps `base` (the session's chunks)
            del s.chunk_keys[base // C :]
            s.flushed = min(s.flushed, base // C)
            p.l4 = l4.pending() if l4 is not None else None
            for i, (src, e) in enumerate(segments):
                if src not in ("l3", "l4") and e.l3_read is None:
                    continue
                if src == "l4" and e.l3_read is None:
                    assert l4 is not None
                    fut = self.directory.start_fetch(e, l4.fetcher(p.l4, e.key))
                    p.l4_reads.add(i)
                else:
                    fut = catalog.start_read(e)
                if fut is None:  # L2 is all in flight: load the prefix before this chunk
                    p.l4_reads.discard(i)
                    self.directory.unpin(rest for _, rest in segments[i:])
                    del segments[i:]
                    break
                p.reads[i] = fut
        except BaseException:
            self._unpin(p)
            raise
        finally:
            if p.l4 is not None:  # every registered L4 read starts (and settles), whatever happened
                assert l4 is not None
                l4.launch(p.l4, s.tenant)
        return p

    def _unpin(self, p: RestorePlan) -> None:
        self.directory.unpin(e for _, e in p.segments)
        p.segments = []

    def _load(self, s: Session, p: RestorePlan) -> None:
        """Phase 2 (no lock): wait for the reads, throttle, copy L2 -> L1 (a staged restore,
        with no L1 buffers: no copy)."""
        t0 = time.perf_counter()
        payload = self.identity.codec.payload_bytes
        usable = len(p.segments)
        for i, fut in p.reads.items():  # in segment order
            if fut.exception() is not None:
                usable = min(usable, i)
                break
        p.l3_bytes = sum(
            payload(p.segments[i][1].tokens) for i in p.reads if i < usable and i not in p.l4_reads
        )
        p.t_l3 = time.perf_counter() - t0
        rate = self.config.l3_read_bytes_per_s
        if p.l3_bytes and rate:
            time.sleep(max(0.0, p.l3_bytes / rate - p.t_l3))
            p.t_l3 = time.perf_counter() - t0
        p.usable = usable
        if not usable or s.bufs is None:
            return
        chunks = [e for _, e in p.segments[:usable]]
        slots = [e.l2_slot for e in chunks]  # pinned and read: stable without the lock
        t1 = time.perf_counter()
        tokens = sum(e.tokens for e in chunks)
        layers, block = s.bufs.layers, s.bufs.block
        # spin: the forward waits for these bytes, and waking from a blocking wait costs more
        handle = self.engine.restore_range(slots, tokens, layers, p.base, block=block)  # type: ignore[arg-type]
        handle.wait(spin=True)
        p.t_l2 = time.perf_counter() - t1

    def _publish(self, s: Session, p: RestorePlan, stage: bool = False) -> str:
        """Phase 3 (guard held): settle the reads, unpin, set the session; returns the deepest
        tier the prefix came from. `stage`: the usable chunks stay pinned, as the session's
        `staged` prefix."""
        d = self.directory
        for i, fut in p.reads.items():
            d.settle_read(p.segments[i][1], fut)
            if i in p.l4_reads and fut.exception() is not None:
                self.counters.misses["l4"] += 1  # evicted, expired, damaged or unreachable
        usable = p.segments[: p.usable]
        if stage and usable:
            p.segments = p.segments[p.usable :]  # unpinned below; the usable ones stay pinned
            s.staged = StagedPrefix([e for _, e in usable], sum(e.tokens for _, e in usable))
        self._unpin(p)
        C = self.identity.chunk_tokens
        n = self.counters
        pos = p.base
        whole = s.flushed == len(s.chunk_keys)  # the chunks L1 kept are stored (flushed)
        deepest = RestoreSource.RECOMPUTE.value
        for src, e in usable:
            if e.tokens == C:
                s.chunk_keys.append(e.key)
            else:  # its stored partial tail, still its own (a turn that fails restores it again)
                s.tail_key = e.key
            pos += e.tokens
            n.hits[src] += 1
            n.restored_tokens[src] += e.tokens
            if DEPTH[src] > DEPTH[deepest]:
                deepest = src
            d.policy.touch(e.key)
        s.flushed = len(s.chunk_keys) if whole else s.flushed
        s.tokens = p.want[:pos]
        s.lengths[:] = [pos] * len(s.lengths)
        n.restored_tokens[RestoreSource.RECOMPUTE.value] += len(p.want) + 1 - pos
        if usable:
            payload = self.identity.codec.payload_bytes
            l2_bytes = sum(payload(e.tokens) for _, e in usable)
            if p.l3_bytes:
                self.cost.observe_load("l3", p.l3_bytes, p.t_l3 + p.t_l2 * p.l3_bytes / l2_bytes)
            l4_bytes = sum(payload(e.tokens) for i, (_, e) in enumerate(usable) if i in p.l4_reads)
            if l4_bytes and self.l4 is not None:
                self.l4.observe(p.l4, l4_bytes, p.t_l2 * l4_bytes / l2_bytes)
            if p.l3_bytes + l4_bytes < l2_bytes and p.t_l2 > 0:  # staged: not copied yet
                l2_only = l2_bytes - p.l3_bytes - l4_bytes
                self.cost.observe_load("l2", l2_only, p.t_l2 * l2_only / l2_bytes)
        return deepest
