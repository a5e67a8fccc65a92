"""Restore, in three phases so that the cache's lock is never held across I/O.

1. plan (under the lock): find the longest cached prefix, let the cost model cut it, pin every
   chunk of it (nobody frees or reuses a pinned chunk's L2 slot), make room in L1, reserve L2
   slots for the L3 chunks and start their reads.
2. load (outside the lock): wait for the L3 reads, sleep out the read throttle, copy the usable
   prefix L2 -> L1 and wait for that copy.
3. publish (under the lock): settle the reads (a chunk that failed to read is forgotten, its
   slot freed), unpin, and set the session's tokens and keys.

A *staged* restore (`TieredCache.restore_staged`, for a batch whose page pool is the sessions'
L1) stops short of L1: it takes no L1 room and copies nothing in phase 2, and phase 3 keeps the
usable prefix's chunks pinned as a `StagedPrefix`. The batch copies them from their L2 slots
straight into its pages when it admits the turn (`TieredCache.load_staged`, one copy per chunk
over PCIe) and then lets them go (`TieredCache.release_staged`).

A session is ACTIVE from phase 1 to its commit, so no one evicts or restores it meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.cache.directory import Chunk
from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key
from kvtier.types import RestoreSource

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.core import TieredCache
    from kvtier.cache.session import Ids, Session

log = logging.getLogger("kvtier.cache")


@dataclass
class RestorePlan:
    want: Ids
    segments: list[tuple[str, Chunk]]
    reads: dict[int, Future[Any]] = field(default_factory=dict)  # segment index -> its L3 read
    l4_reads: set[int] = field(default_factory=set)  # the reads above that come from L4
    l4: Any = None  # kvtier.cache.l4.PendingReads of this plan
    usable: int = 0  # leading segments whose bytes reached L1
    base: int = 0  # tokens kept in L1 before the first segment (its chunks are the session's)
    l3_bytes: int = 0
    t_l3: float = 0.0
    t_l2: float = 0.0


@dataclass(eq=False)
class StagedPrefix:
    """A restored prefix left in L2 for the caller to copy where it computes: the first
    `tokens` tokens, in the L2 slots of `chunks` (full chunks, the last may be partial), each
    pinned (its slot neither freed nor reused) until the cache releases it."""

    chunks: list[Chunk]
    tokens: int

    @property
    def slots(self) -> list[int]:
        return [e.l2_slot for e in self.chunks]  # type: ignore[misc]  # pinned: in L2


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share. List comparisons run in C: the usual case, one
    list extending the other, is one comparison, and a mismatch is found by bisection over
    slices. A loop in Python over thousands of tokens, on every restore (and `publish_shared`),
    took the GIL from the batch scheduler's thread for as long."""
    if type(a) is not type(b):  # a tuple never equals a list: compare two tuples
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def locate(cache: TieredCache, key: bytes, parent: bytes = ZERO_KEY) -> tuple[Chunk | None, str]:
    """Where `key` can be loaded from: "l2" (a ready slot, or a read in flight that the
    restore waits for outside the lock), "l3" (a file) or "l4" (believed in the shared tier).
    Never waits."""
    d = cache.directory
    e = d.get(key)
    if e is not None and e.l3_read is not None and e.l3_read.done():
        settle_read(cache, e, e.l3_read)
    if e is not None and e.l2_slot is not None and e.l3_read is None:
        return e, "l2"
    cache.counters.misses["l2"] += 1
    if e is not None and e.l3_read is not None:
        return e, "l2"  # a prefetch is bringing it into L2; the restore waits for it
    tokens = d.l3_tokens.get(key)
    if tokens is None:
        if cache.l4 is not None and cache.l4.store.up and (tokens := cache.l4.known.get(key)):
            return d.ensure(key, parent, tokens), "l4"
        return None, ""
    return d.ensure(key, parent, tokens), "l3"


def settle_read(cache: TieredCache, e: Chunk, fut: Future[Any]) -> None:
    cache.directory.settle_read(e, fut)


def start_read(cache: TieredCache, e: Chunk) -> Future[Any] | None:
    return cache.directory.start_read(e, cache.fingerprint)


def held(cache: TieredCache, key: bytes) -> bool:
    """Whether L2, L3 or L4 holds the chunk `key` (without counting a hit or a miss)."""
    e = cache.directory.get(key)
    if (e is not None and e.l2_slot is not None) or cache.directory.in_l3(key):
        return True
    return cache.l4 is not None and cache.l4.store.up and key in cache.l4.known


def tiers_extend(cache: TieredCache, s: Session, want: Ids, common: int, whole: bool) -> bool:
    """Whether L2/L3/L4 hold a longer prefix of `want` than the `common` tokens that L1 (or
    a batch's pages) share with it: the full chunk of `want` holding token `common`, after
    the session's chunks before it. After a history edit the session's tokens in L1 may
    share a short prefix with `want` while its chunks stored earlier match much more.
    `whole`: those earlier chunks must be stored too (the restore loads from token 0)."""
    C = cache.chunk_tokens
    k = common // C
    if len(want) < (k + 1) * C or len(s.chunk_keys) < k:
        return False
    parent = s.chunk_keys[k - 1] if k else ZERO_KEY
    if not held(cache, cache.key_for(parent, want[k * C : (k + 1) * C], s)):
        return False
    return not whole or all(held(cache, key) for key in s.chunk_keys[:k])


def plan(cache: TieredCache, s: Session, want: Ids, staged: bool = False) -> RestorePlan | None:
    """Phase 1 (under the lock). None: served from L1, nothing to load. L1 gets room for the
    whole of `want` and the token after it, where the forward will write them; `staged`: none
    (the prefix stays in L2, see `StagedPrefix`). Where L2/L3 hold more of `want` than L1
    (`tiers_extend`), L1 keeps its full chunks in common with `want` (none when staged) and
    the chunks after them are loaded."""
    C = cache.chunk_tokens
    n = cache.counters
    s.in_pages = False  # a batch's pages of it, if any, are not what this turn starts from
    base = 0
    if s.resident:
        common = common_prefix(s.tokens, want)
        if tiers_extend(cache, s, want, common, whole=staged):
            base = 0 if staged else common // C * C
            n.hits["l1"] += base > 0
            n.restored_tokens["l1"] += base
        elif common > 0:
            cache.truncate(s, common)
            n.hits["l1"] += 1
            n.restored_tokens["l1"] += common
            return None
        cache.truncate(s, base)
    n.misses["l1"] += 1
    segments: list[tuple[str, Chunk]] = []
    parent = s.chunk_keys[-1] if base else ZERO_KEY
    tail = len(s.tokens) % C if s.tail_key is not None else 0
    for i in range(base // C, len(want) // C + 1):
        toks = want[i * C : (i + 1) * C]
        entry: Chunk | None = None
        src = ""
        if len(toks) == C:
            key, shared = cache.keyed(parent, toks, s)
            entry, src = locate(cache, key, parent)
            if entry is not None and not entry.tenant:  # found in L3: whose is it (shred)?
                entry.tenant = SHARED_TENANT if shared else s.tenant
        if (
            entry is None
            and tail
            and len(toks) >= tail
            and chunk_key(parent, toks[:tail], s.ns) == s.tail_key
        ):
            # the session's own hibernated partial tail, at the end of its stored prefix
            entry, src = locate(cache, s.tail_key, parent)
            if entry is not None and not entry.tenant:
                entry.tenant = s.tenant
        if entry is None:
            n.misses["l3"] += 1
            if cache.l4 is not None:
                n.misses["l4"] += 1
            break
        segments.append((src, entry))
        parent = entry.key
        if entry.tokens < C:
            break
    if cache.config.cost_model:
        payload = cache.codec.payload_bytes
        keep = cache.cost.plan([(src, payload(e.tokens), e.tokens) for src, e in segments])
        segments = segments[:keep]
    p = RestorePlan(want, segments, base=base)
    for _, e in segments:
        e.pins += 1
    try:
        loaded = sum(e.tokens for _, e in segments)
        if not staged:
            cache.alloc_l1(s, max(len(want) + 1, base + loaded))
        s.tokens, s.tail_key = s.tokens[:base], None  # L1 keeps `base` (the session's chunks)
        del s.chunk_keys[base // C :]
        s.flushed = min(s.flushed, base // C)
        p.l4 = cache.l4.pending() if cache.l4 is not None else None
        for i, (src, e) in enumerate(segments):
            if src not in ("l3", "l4") and e.l3_read is None:
                continue
            if src == "l4" and e.l3_read is None:
                fut = cache.directory.start_fetch(e, cache.l4.fetcher(p.l4, e.key))  # type: ignore[union-attr]
                p.l4_reads.add(i)
            else:
                fut = start_read(cache, e)
            if fut is None:  # L2 is all in flight: load the prefix before this chunk
                p.l4_reads.discard(i)
                for _, rest in segments[i:]:
                    rest.pins -= 1
                del segments[i:]
                break
            p.reads[i] = fut
    except BaseException:
        unpin(p)
        raise
    finally:
        if p.l4 is not None:  # every registered L4 read starts (and settles), whatever happened
            cache.l4.launch(p.l4, s.tenant)  # type: ignore[union-attr]
    return p


def unpin(p: RestorePlan) -> None:
    for _, e in p.segments:
        e.pins -= 1
    p.segments = []


def load(cache: TieredCache, s: Session, p: RestorePlan) -> None:
    """Phase 2 (outside the lock): wait for the reads, throttle, copy L2 -> L1 (a staged
    restore, with no L1 buffers: no copy)."""
    t0 = time.perf_counter()
    usable = len(p.segments)
    for i, fut in p.reads.items():  # in segment order
        if fut.exception() is not None:
            usable = min(usable, i)
            break
    p.l3_bytes = sum(
        cache.codec.payload_bytes(p.segments[i][1].tokens)
        for i in p.reads
        if i < usable and i not in p.l4_reads
    )
    p.t_l3 = time.perf_counter() - t0
    rate = cache.config.l3_read_bytes_per_s
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
    handle = cache.engine.restore_range(slots, tokens, layers, p.base, block=block)  # type: ignore[arg-type]
    handle.wait(spin=True)
    p.t_l2 = time.perf_counter() - t1


def publish(cache: TieredCache, s: Session, p: RestorePlan, stage: bool = False) -> str:
    """Phase 3 (under the lock): settle the reads, unpin, set the session; returns the
    deepest tier the prefix came from. `stage`: the usable chunks stay pinned, as the
    session's `staged` prefix."""
    for i, fut in p.reads.items():
        settle_read(cache, p.segments[i][1], fut)
        if i in p.l4_reads and fut.exception() is not None:
            cache.counters.misses["l4"] += 1  # evicted, expired, damaged or unreachable
    usable = p.segments[: p.usable]
    if stage and usable:
        p.segments = p.segments[p.usable :]  # unpinned below; the usable ones stay pinned
        s.staged = StagedPrefix([e for _, e in usable], sum(e.tokens for _, e in usable))
    unpin(p)
    C = cache.chunk_tokens
    n = cache.counters
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
        if _DEPTH[src] > _DEPTH[deepest]:
            deepest = src
        cache.directory.policy.touch(e.key)
    s.flushed = len(s.chunk_keys) if whole else s.flushed
    s.tokens = p.want[:pos]
    s.lengths[:] = [pos] * len(s.lengths)
    n.restored_tokens[RestoreSource.RECOMPUTE.value] += len(p.want) + 1 - pos
    if usable:
        l2_bytes = sum(cache.codec.payload_bytes(e.tokens) for _, e in usable)
        if p.l3_bytes:
            cache.cost.observe_load("l3", p.l3_bytes, p.t_l3 + p.t_l2 * p.l3_bytes / l2_bytes)
        l4_bytes = sum(
            cache.codec.payload_bytes(e.tokens)
            for i, (_, e) in enumerate(usable)
            if i in p.l4_reads
        )
        if l4_bytes and cache.l4 is not None:
            cache.l4.observe(p.l4, l4_bytes, p.t_l2 * l4_bytes / l2_bytes)
        if p.l3_bytes + l4_bytes < l2_bytes and p.t_l2 > 0:  # staged: not copied yet
            l2_only = l2_bytes - p.l3_bytes - l4_bytes
            cache.cost.observe_load("l2", l2_only, p.t_l2 * l2_only / l2_bytes)
    return deepest


# The deepest source of a restore names it (`restore_source`).
_DEPTH = {RestoreSource.RECOMPUTE.value: 0, "l1": 1, "l2": 2, "l3": 3, "l4": 4}


def prefetch(cache: TieredCache, s: Session) -> None:
    """Start L3 -> L2 reads of the session's chunks (under the lock; never waits)."""
    for key in [*s.chunk_keys] + ([s.tail_key] if s.tail_key else []):
        e, src = locate(cache, key)
        if e is None:
            break
        if src == "l3" and start_read(cache, e) is None:
            break
