"""Restorer: a returning turn's prefix back from the tiers, in three phases so that the cache's
guard is never held across I/O.

1. plan (guard held): find the longest cached prefix and the cold tier each chunk of it is in
   (`ChunkCatalog.segments`), let the cost model cut it, pin every chunk of it (nobody frees or
   reuses a pinned chunk's L2 slot), make room in L1 (`L1Room`), and have each chunk's tier
   start reading it into an L2 slot (`ColdTier.start_read`, `launch`) unless it is ready there.
2. load (no lock): wait for the reads, sleep out L3's read throttle, copy the usable prefix
   L2 -> L1 and wait for that copy.
3. publish (guard held): settle the reads (a chunk that failed to read is forgotten, its slot
   freed), unpin, set the session's tokens and keys, and tell each tier what it loaded
   (`ColdTier.observe`).

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

from kvtier.cache.restoreplan import RestorePlan, StagedPrefix, common_prefix
from kvtier.errors import SessionError
from kvtier.integrations.hf import KvtierCache
from kvtier.snapshot import RESTORE_BUCKETS
from kvtier.types import RestoreSource, SessionState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.catalog import ChunkCatalog
    from kvtier.cache.coldtier import ColdTier
    from kvtier.cache.config import CacheConfig
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.directory import ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l1room import L1Room
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
                return self._restored(s, RestoreSource.L1.value, t0)
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
            self.counters.hits[Tier.L1.value] += 1
            self.counters.restored_tokens[Tier.L1.value] += n
            self.count(s, RestoreSource.L1.value, t0)
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
        """(guard held) Count a restore from `source` (a `RestoreSource` or a registered tier's
        name) that began at `t0`."""
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
                n.hits[Tier.L1] += base > 0
                n.restored_tokens[Tier.L1] += base
            elif common > 0:
                s.truncate(common)
                n.hits[Tier.L1] += 1
                n.restored_tokens[Tier.L1] += common
                return None
            s.truncate(base)
        n.misses[Tier.L1] += 1
        segments = catalog.segments(s, want, base)
        if self.config.cost_model:
            payload = self.identity.codec.payload_bytes
            keep = self.cost.plan([(t.tier, payload(e.tokens), e.tokens) for t, e in segments])
            segments = segments[:keep]
        p = RestorePlan(want, segments, base=base)
        self.directory.pin([e for _, e in segments])
        try:
            loaded = sum(e.tokens for _, e in segments)
            if not staged:
                self.room.alloc(s, max(len(want) + 1, base + loaded))
            s.tokens, s.tail_key = s.tokens[:base], None  # L1 keeps `base` (the session's chunks)
            del s.chunk_keys[base // C :]
            s.flushed = min(s.flushed, base // C)
            for i, (tier, e) in enumerate(segments):
                if e.l2_slot is not None and e.l3_read is None:  # ready in L2: copied, not read
                    p.reads_of(tier).segments.append(i)
                    continue
                fut = tier.start_read(e, p.reads_of(tier))
                if fut is None:  # L2 is all in flight: load the prefix before this chunk
                    self.directory.unpin([rest for _, rest in segments[i:]])
                    del segments[i:]
                    break
                p.reads[i] = fut
                p.reads_of(e.reader or tier).segments.append(i)
        except BaseException:
            self._unpin(p)
            raise
        finally:  # every registered read starts (and settles), whatever happened
            for r in p.by_tier.values():
                r.tier.launch(r, s.tenant)
        return p

    def _unpin(self, p: RestorePlan) -> None:
        self.directory.unpin([e for _, e in p.segments])
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
        p.t_read = time.perf_counter() - t0
        rate = self.config.l3_read_bytes_per_s  # L3's read throttle (shared disks, tests)
        l3 = p.by_tier.get(Tier.L3)
        l3_bytes = 0
        if l3 is not None:
            l3_bytes = sum(payload(p.segments[i][1].tokens) for i in l3.segments if i < usable)
        if l3_bytes and rate:
            time.sleep(max(0.0, l3_bytes / rate - p.t_read))
            p.t_read = time.perf_counter() - t0
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
        p.t_copy = time.perf_counter() - t1

    def _publish(self, s: Session, p: RestorePlan, stage: bool = False) -> str:
        """Phase 3 (guard held): settle the reads, unpin, set the session; returns the deepest
        tier the prefix came from. `stage`: the usable chunks stay pinned, as the session's
        `staged` prefix."""
        d = self.directory
        for i, fut in p.reads.items():
            d.settle_read(p.segments[i][1], fut)
        chunks = [e for _, e in p.segments]
        for r in p.by_tier.values():
            r.failed = sum(p.reads[i].exception() is not None for i in r.segments if i in p.reads)
        usable = p.segments[: p.usable]
        if stage and usable:
            p.segments = p.segments[p.usable :]  # unpinned below; the usable ones stay pinned
            s.staged = StagedPrefix([e for _, e in usable], sum(e.tokens for _, e in usable))
        self._unpin(p)
        C = self.identity.chunk_tokens
        n = self.counters
        pos = p.base
        whole = s.flushed == len(s.chunk_keys)  # the chunks L1 kept are stored (flushed)
        deepest: ColdTier | None = None
        tiers = self.catalog.tiers
        for tier, e in usable:
            if e.tokens == C:
                s.chunk_keys.append(e.key)
            else:  # its stored partial tail, still its own (a turn that fails restores it again)
                s.tail_key = e.key
            pos += e.tokens
            n.hits[tier.tier] += 1
            n.restored_tokens[tier.tier] += e.tokens
            if deepest is None or tiers.depth(tier) > tiers.depth(deepest):
                deepest = tier
            d.touch(e.key)
        s.flushed = len(s.chunk_keys) if whole else s.flushed
        s.tokens = p.want[:pos]
        s.lengths[:] = [pos] * len(s.lengths)
        n.restored_tokens[RestoreSource.RECOMPUTE.value] += len(p.want) + 1 - pos
        # each tier's share of the usable prefix: its bytes, and as much of the copy's time
        payload = self.identity.codec.payload_bytes
        usable_bytes = sum(payload(e.tokens) for e in chunks[: p.usable])
        for r in p.by_tier.values():
            nbytes = sum(payload(chunks[i].tokens) for i in r.segments if i < p.usable)
            t_copy = p.t_copy * nbytes / usable_bytes if usable_bytes else 0.0
            r.tier.observe(r, nbytes, p.t_read, t_copy)
        return RestoreSource.RECOMPUTE.value if deepest is None else deepest.tier
