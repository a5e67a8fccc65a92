"""ChunkDirectory: where each chunk of a TieredCache lives, and who may drop it.

The directory maps a chunk key to a `Chunk` entry: its L2 slot (if any), its L3 write or
read in flight, and how many restores are reading it right now (`pins`). Whether a chunk is
in L3 is one map, `key -> tokens`, loaded from the L3 index at start and kept true by the
store's eviction listener: keys the store deletes (size cap, TTL, gc) arrive on a queue that
is drained under the cache's lock before any decision that relies on L3 holding a chunk.

An entry is reclaimed (`sweep`) once no session references its key, no tier holds it in L2 and
nothing is in flight on it; the L3 map alone remembers chunks that only L3 holds. So the
number of entries stays bounded by the live sessions' chunks plus the L2 slots.

Every method runs under the cache's lock (the caller holds it) except `on_l3_evicted`, which
the store calls from its own threads and which only appends to a queue.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import (
    ChunkNotFound,
    FingerprintMismatch,
    KvbinFormatError,
    StoreFullError,
    TenantKeyShredded,
)
from kvtier.policy import EvictionPolicy
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine
from kvtier.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.coldtier import ColdTier

log = logging.getLogger("kvtier.cache")


@dataclass(eq=False)
class Chunk:
    """Where copies of one chunk exist. L1 copies belong to sessions, not to this entry."""

    key: bytes
    parent: bytes
    tokens: int
    tenant: str = ""  # the tenant its L3 header names (the shared tenant for published chunks)
    l2_slot: int | None = None
    l3_write: Future[Any] | None = None  # in-flight L2 -> L3 write
    l3_read: Future[Any] | None = None  # in-flight read into the L2 slot (prefetch or restore)
    reader: ColdTier | None = None  # the tier that read comes from
    pins: int = 0  # restores copying from this chunk's L2 slot right now
    seen: int = 0

    @property
    def busy(self) -> bool:
        """Something is in flight on the entry: its slot must be neither freed nor reused."""
        return self.pins > 0 or self.l3_read is not None or self.l3_write is not None


class _Busy:
    """The `exclude` container handed to the L2 policy when it picks a victim."""

    def __init__(self, directory: ChunkDirectory, durable_only: bool) -> None:
        self.d = directory
        self.durable_only = durable_only
        self.extra: set[bytes] = set()

    def __contains__(self, key: object) -> bool:
        if key in self.extra:
            return True
        e = self.d.entries.get(key)  # type: ignore[call-overload]
        if e is None or e.l2_slot is None:
            return False  # a stale policy entry: let the caller drop it
        if e.pins or e.l3_read is not None:
            return True
        if e.l3_write is not None and not e.l3_write.done():
            return True
        return self.durable_only and not self.d.in_l3(e.key) and e.l3_write is None


class ChunkDirectory:
    """Chunk entries, their L2 slots and L3 presence; see the module docstring."""

    def __init__(
        self,
        arena: HostArena,
        engine: TransferEngine,
        policy: EvictionPolicy,
        l3_tokens: dict[bytes, int],
        header: Callable[[Chunk], Any],
        counters: Any,
    ) -> None:
        self.arena = arena
        self.engine = engine
        self.policy = policy
        self.entries: dict[bytes, Chunk] = {}
        self.l3_tokens = l3_tokens  # key -> tokens of this model's chunks believed in L3
        self.writing: set[bytes] = set()  # keys with an L2 -> L3 write in flight
        self.reading: set[bytes] = set()  # keys with a read into their L2 slot in flight
        self._header = header
        self._n = counters
        self._evicted: collections.deque[list[bytes]] = collections.deque()
        self._sweep_at = 256
        # sightings of reclaimed chunks (bounded, oldest forgotten first)
        self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._seen_max = max(4096, 4 * arena.n_slots)
        # keys whose L3 write was shed (the queue was full) -> when first shed; queued again
        # by `retry_unwritten` while `retry_shed` (write_through: every committed chunk is
        # to reach L3 within `CacheConfig.l3_write_bound_s`)
        self.unwritten: dict[bytes, float] = {}
        self.retry_shed = False

    # -- read API (sessions, snapshots) ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Chunk | None:
        return self.entries.get(key)

    def in_l3(self, key: bytes) -> bool:
        return key in self.l3_tokens

    def in_l2(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.l2_slot is not None and e.l3_read is None

    def count(self, keys: Iterable[bytes]) -> tuple[int, int]:
        """(chunks in L2, chunks in L3) among `keys`."""
        l2 = l3 = 0
        for k in keys:
            l2 += self.in_l2(k)
            l3 += k in self.l3_tokens
        return l2, l3

    # -- entries ---------------------------------------------------------------------------------

    def ensure(self, key: bytes, parent: bytes, tokens: int) -> Chunk:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Chunk(key=key, parent=parent, tokens=tokens)
            e.seen = self._seen.pop(key, 0)
        return e

    def touch(self, key: bytes) -> None:
        """The chunk was just used (restored, stored): the L2 eviction policy keeps it longer."""
        self.policy.touch(key)

    @staticmethod
    def pin(chunks: Sequence[Chunk]) -> None:
        """Keep the chunks' L2 slots: a pinned chunk's slot is neither freed nor reused."""
        for e in chunks:
            e.pins += 1

    @staticmethod
    def unpin(chunks: Sequence[Chunk]) -> None:
        for e in chunks:
            e.pins -= 1

    def stored(self, e: Chunk) -> bool:
        """Some tier holds (or is writing) the chunk."""
        return e.l2_slot is not None or e.key in self.l3_tokens or e.l3_write is not None

    def set_in_l3(self, e: Chunk, durable: bool) -> None:
        if durable:
            self.l3_tokens[e.key] = e.tokens
        else:
            self.l3_tokens.pop(e.key, None)

    def forget_l3(self, key: bytes) -> None:
        """L3 does not hold `key` after all (a read found no file, or failed its checksum)."""
        self.l3_tokens.pop(key, None)

    def sweep(self, live: Callable[[], set[bytes]], force: bool = False) -> int:
        """Reclaim entries no session references and no tier holds; returns how many.

        Amortized: runs when the directory has doubled since the last sweep (or `force`)."""
        if not force and len(self.entries) < self._sweep_at:
            return 0
        keep = live()
        dead = [
            k for k, e in self.entries.items() if k not in keep and e.l2_slot is None and not e.busy
        ]
        for k in dead:
            seen = self.entries.pop(k).seen
            if seen:  # write_through_selective counts sightings across sessions
                self._seen[k] = seen
                self._seen.move_to_end(k)
        while len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)
        self._sweep_at = max(256, 2 * len(self.entries))
        return len(dead)

    # -- L3 evictions reported by the store -----------------------------------------------------

    def on_l3_evicted(self, keys: list[bytes]) -> None:
        """The store's eviction listener: called from its threads, so only queue the keys."""
        self._evicted.append(list(keys))

    def drain_evictions(self) -> int:
        """Apply the store's evictions (under the cache's lock); returns the keys dropped."""
        n = 0
        while self._evicted:
            for key in self._evicted.popleft():
                if self.l3_tokens.pop(bytes(key), None) is not None:
                    n += 1
        if n:
            self._n.evictions[Tier.L3] += n
        return n

    # -- L3 writes -------------------------------------------------------------------------------

    def queue_write(self, e: Chunk) -> None:
        if e.key in self.l3_tokens or e.l3_write is not None or e.l2_slot is None:
            return
        e.l3_write = self.engine.write_l3(e.l2_slot, self._header(e))  # None: shed
        if e.l3_write is not None:
            self.writing.add(e.key)
            self.unwritten.pop(e.key, None)
        elif self.retry_shed:
            self.unwritten.setdefault(e.key, time.monotonic())

    def retry_unwritten(self) -> list[Future[Any]]:
        """Queue the shed L3 writes (`unwritten`) again, oldest first, as far as the queue
        has room. Returns [] when none is left, else the writes in flight: once one of them
        is done the queue has room (the caller waits outside the lock, then calls again)."""
        entries = (self.entries.get(k) for k in self.writing)
        writes = [e.l3_write for e in entries if e is not None and e.l3_write is not None]
        room = self.engine.l3_write_queue - sum(not f.done() for f in writes)
        for key in list(self.unwritten):
            e = self.entries.get(key)
            if e is None or e.l2_slot is None or e.l3_write is not None or self.in_l3(key):
                del self.unwritten[key]  # in L3, on its way, or gone from L2 (written first)
                continue
            if room <= 0:
                break  # not shed once more (and counted): wait for a write to finish
            self.queue_write(e)
            if e.l3_write is None:
                break  # shed after all (another write took the room)
            writes.append(e.l3_write)
            room -= 1
        return writes if self.unwritten else []

    def settle_write(self, e: Chunk, fut: Future[Any]) -> None:
        """Publish a finished write (idempotent: only the entry's current future counts)."""
        if e.l3_write is not fut:
            return
        e.l3_write = None
        self.writing.discard(e.key)
        exc = fut.exception()
        if exc is None:
            self.set_in_l3(e, True)
        elif isinstance(exc, StoreFullError):
            self._n.l3_full += 1
        else:
            log.warning("L3 write of %s failed: %s", e.key.hex(), exc)

    def reap_writes(self) -> None:
        """Harvest finished L2 -> L3 writes and L3 -> L2 reads (only chunks with one in
        flight), and the store's evictions."""
        self.drain_evictions()
        for key in list(self.writing):
            e = self.entries.get(key)
            fut = e.l3_write if e is not None else None
            if e is None or fut is None:
                self.writing.discard(key)
            elif fut.done():
                self.settle_write(e, fut)
        self.reap_reads()
        self.drain_evictions()

    def reap_reads(self) -> None:
        for key in list(self.reading):
            e = self.entries.get(key)
            rfut = e.l3_read if e is not None else None
            if e is None or rfut is None:
                self.reading.discard(key)
            elif rfut.done():
                self.settle_read(e, rfut)

    # -- L3 reads --------------------------------------------------------------------------------

    def start_fetch(
        self, e: Chunk, fetch: Callable[[int], Future[Any]], tier: ColdTier
    ) -> Future[Any] | None:
        """Reserve an L2 slot for `e` and have `tier` start filling it (`fetch(slot)`), or join
        the read in flight; None if L2 has no free slot. The read is tracked (`e.l3_read`,
        `e.reader`) until `settle_read`."""
        if e.l3_read is not None:
            return e.l3_read
        slot = self.alloc()
        if slot is None:
            return None
        e.l2_slot = slot  # reserved: usable once the read succeeded
        e.l3_read = fetch(slot)
        e.reader = tier
        self.reading.add(e.key)
        self.policy.touch(e.key)
        return e.l3_read

    def settle_read(self, e: Chunk, fut: Future[Any]) -> None:
        """Publish a finished read into an L2 slot (idempotent). A chunk that is gone or corrupt is
        forgotten, so no later restore tries it again."""
        if e.l3_read is not fut:
            return
        reader, e.l3_read, e.reader = e.reader, None, None
        self.reading.discard(e.key)
        exc = fut.exception()
        if exc is None:
            self.policy.touch(e.key)
            return
        if e.l2_slot is not None:
            self.free_slot(e)
        if isinstance(
            exc, (ChunkNotFound, KvbinFormatError, FingerprintMismatch, TenantKeyShredded)
        ):
            self._n.checksum_failures += isinstance(exc, KvbinFormatError)
            if reader is not None and reader.tier == Tier.L3:  # another tier forgets its own
                self.forget_l3(e.key)
        log.warning("read of %s into L2 failed (%s); recomputing from there", e.key.hex(), exc)

    # -- L2 slots ----------------------------------------------------------------------------------

    def free_slot(self, e: Chunk) -> None:
        """Drop the entry's L2 copy (the caller made sure it is not the last one needed)."""
        slot, e.l2_slot = e.l2_slot, None
        if slot is not None:
            self.engine.forget(slot)
            self.arena.free(slot)
        self.policy.remove(e.key)

    def release_slot(self, slot: int) -> None:
        """Return a slot that no entry owns (a failed or abandoned read)."""
        self.engine.forget(slot)
        self.arena.free(slot)

    def alloc(self) -> int | None:
        """A free L2 slot, evicting the policy's victim if needed; None if every slot is busy.

        Durable victims (also in L3) go first. Only when every candidate is L2's only copy is
        one written back to L3 first (write_back policy), which waits for that write.
        """
        slot = self.arena.alloc()
        if slot is not None:
            return slot
        self.reap_reads()  # a finished prefetch nobody used yet is an ordinary L2 copy
        self.drain_evictions()
        for durable_only in (True, False):
            exclude = _Busy(self, durable_only)
            while slot is None:
                victim = self.policy.victim(exclude=exclude)
                if victim is None:
                    break
                e = self.entries.get(victim)  # type: ignore[call-overload]
                if e is None or e.l2_slot is None:
                    self.policy.remove(victim)
                    continue
                if e.l3_write is not None:
                    self.settle_write(e, e.l3_write)  # done (busy ones are excluded)
                    self.drain_evictions()
                if e.key not in self.l3_tokens and (durable_only or not self._write_back(e)):
                    exclude.extra.add(e.key)
                    continue
                self.free_slot(e)
                self._n.evictions[Tier.L2] += 1
                slot = self.arena.alloc()
            if slot is not None:
                return slot
        return None

    def wait_for_room(self) -> float | None:
        """Wait for one L3 write or read in flight on an L2 slot to finish, and settle what
        finished, so that `alloc` may find a victim again (backpressure: a chunk leaving L1
        waits for the disk rather than being dropped). Runs under the cache's lock, like
        `_write_back`: the disk's threads never take it. Returns the seconds waited, or None
        when nothing in flight could free a slot (no L3 I/O left, or only on chunks a restore
        has pinned, which the lock keeps from finishing)."""
        futures: list[Future[Any]] = []
        for key in self.writing:
            e = self.entries.get(key)
            if e is not None and e.l3_write is not None and e.l2_slot is not None and not e.pins:
                futures.append(e.l3_write)
        for key in self.reading:
            e = self.entries.get(key)
            if e is not None and e.l3_read is not None and not e.pins:
                futures.append(e.l3_read)
        if not futures:
            return None
        t0 = time.perf_counter()
        wait(futures, return_when=FIRST_COMPLETED)
        waited = time.perf_counter() - t0
        self.reap_writes()
        return waited

    def _write_back(self, e: Chunk) -> bool:
        """Make L2's only copy durable before dropping it; False if that failed."""
        assert e.l2_slot is not None
        fut = self.engine.write_l3(e.l2_slot, self._header(e))
        if fut is None:
            return False
        try:
            fut.result()
        except Exception as exc:
            log.warning("write-back of %s failed: %s", e.key.hex(), exc)
            return False
        self.set_in_l3(e, True)
        self.drain_evictions()
        return e.key in self.l3_tokens

    def drop_l2_durable(self) -> int:
        """Free every idle L2 copy that L3 also holds; returns how many."""
        self.drain_evictions()
        dropped = 0
        for e in list(self.entries.values()):
            if e.l2_slot is not None and e.key in self.l3_tokens and not e.busy:
                self.free_slot(e)
                self._n.evictions[Tier.L2] += 1
                dropped += 1
        return dropped
