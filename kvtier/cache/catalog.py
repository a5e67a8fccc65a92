"""ChunkCatalog: which key a chunk has, and where a chunk can be loaded from.

Keys come from `kvtier.cache.keys`: a chunk's key hashes its parent's key, its tokens and the
namespace of its tenant, or the shared namespace where that prefix was published to every
tenant (`TieredCache.publish_shared`). The catalog answers from the chunk directory (L2 slots,
reads in flight, L3's keys) and from the shared tier's keys (L4); it never waits, and it
never calls back into the cache. Every method runs with the guard held.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvtier.cache.keys import ZERO_KEY, chunk_key

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l4 import SharedTier
    from kvtier.cache.session import Ids, Session
    from kvtier.cache.stats import Counters


class ChunkCatalog:
    def __init__(
        self,
        identity: CacheIdentity,
        directory: ChunkDirectory,
        l4: SharedTier | None,
        counters: Counters,
        *,
        published: bool,
    ) -> None:
        self.identity = identity
        self.directory = directory
        self.l4 = l4
        self.counters = counters
        # some prefix is published to every tenant (also found in L3 at start)
        self._published = published

    def mark_published(self) -> None:
        """From now on shared keys are looked for (before any shared key exists)."""
        self._published = True

    def key_for(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes:
        """Key of a full chunk: the shared namespace's if that prefix was published."""
        return self.keyed(parent, toks, s)[0]

    def keyed(self, parent: bytes, toks: Sequence[int], s: Session) -> tuple[bytes, bool]:
        """`key_for`, and whether the key is the shared namespace's. A shared key is looked for
        only where one can exist: something was published into this store (also set from L3
        at start), or another host's may be in L4. Otherwise the session's own key is the
        only one, and one hash instead of two (a restore hashes every chunk)."""
        if self._published or self.l4 is not None:
            shared = chunk_key(parent, toks, self.identity.shared_ns)
            d = self.directory
            if d.get(shared) is not None or (self._published and d.in_l3(shared)):
                return shared, True
            if self.l4 is not None and shared in self.l4.known:  # published on another host
                return shared, True
        return chunk_key(parent, toks, s.ns), False

    def locate(self, key: bytes, parent: bytes = ZERO_KEY) -> tuple[Chunk | None, str]:
        """Where `key` can be loaded from: "l2" (a ready slot, or a read in flight that the
        restore waits for outside the lock), "l3" (a file) or "l4" (believed in the shared
        tier). Never waits."""
        d = self.directory
        e = d.get(key)
        if e is not None and e.l3_read is not None and e.l3_read.done():
            d.settle_read(e, e.l3_read)
        if e is not None and e.l2_slot is not None and e.l3_read is None:
            return e, "l2"
        self.counters.misses["l2"] += 1
        if e is not None and e.l3_read is not None:
            return e, "l2"  # a prefetch is bringing it into L2; the restore waits for it
        tokens = d.l3_tokens.get(key)
        if tokens is None:
            l4 = self.l4
            if l4 is not None and l4.store.up and (tokens := l4.known.get(key)):
                return d.ensure(key, parent, tokens), "l4"
            return None, ""
        return d.ensure(key, parent, tokens), "l3"

    def start_read(self, e: Chunk) -> Future[Any] | None:
        """L3 -> an L2 slot; None when every L2 slot is in flight."""
        return self.directory.start_read(e, self.identity.fingerprint)

    def held(self, key: bytes) -> bool:
        """Whether L2, L3 or L4 holds the chunk `key` (without counting a hit or a miss)."""
        e = self.directory.get(key)
        if (e is not None and e.l2_slot is not None) or self.directory.in_l3(key):
            return True
        return self.l4 is not None and self.l4.store.up and key in self.l4.known

    def tiers_extend(self, s: Session, want: Ids, common: int, whole: bool) -> bool:
        """Whether L2/L3/L4 hold a longer prefix of `want` than the `common` tokens that L1 (or
        a batch's pages) share with it: the full chunk of `want` holding token `common`, after
        the session's chunks before it. After a history edit the session's tokens in L1 may
        share a short prefix with `want` while its chunks stored earlier match much more.
        `whole`: those earlier chunks must be stored too (the restore loads from token 0)."""
        C = self.identity.chunk_tokens
        k = common // C
        if len(want) < (k + 1) * C or len(s.chunk_keys) < k:
            return False
        parent = s.chunk_keys[k - 1] if k else ZERO_KEY
        if not self.held(self.key_for(parent, want[k * C : (k + 1) * C], s)):
            return False
        return not whole or all(self.held(key) for key in s.chunk_keys[:k])

    def prefetch(self, s: Session) -> None:
        """Start L3 -> L2 reads of the session's chunks (never waits)."""
        for key in [*s.chunk_keys] + ([s.tail_key] if s.tail_key else []):
            e, src = self.locate(key)
            if e is None:
                break
            if src == "l3" and self.start_read(e) is None:
                break
