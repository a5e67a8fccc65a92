"""ChunkCatalog: which key a chunk has, and where a chunk can be loaded from.

Keys come from `kvtier.cache.keys`: a chunk's key hashes its parent's key, its tokens and the
namespace of its tenant, or the shared namespace where that prefix was published to every
tenant (`TieredCache.publish_shared`). Where a chunk is, the catalog asks the cold tiers
(`kvtier.cache.coldtier.ColdTiers`) in their order, nearest first; it never waits, and it never
calls back into the cache. Every method runs with the guard held.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key
from kvtier.cache.restoreplan import TierReads
from kvtier.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.coldtier import ColdTier
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.session import Ids, Session
    from kvtier.cache.stats import Counters

Segment = tuple["ColdTier", "Chunk"]
"""A chunk of a restore's prefix and the tier it was found in."""


class ColdTiers:
    """The cold tiers (`kvtier.cache.coldtier.ColdTier`) in the order a restore asks them,
    nearest first: L2, L3, then L4 where the cache has one, and any tier registered since where
    it was put."""

    def __init__(
        self, tiers: Iterable[ColdTier], on_register: Callable[[ColdTier], None] | None = None
    ) -> None:
        self._tiers = list(tiers)
        self._on_register = on_register

    def register(self, tier: ColdTier, *, after: str | None = None) -> None:
        """Add `tier`, asked right after the tier named `after` (last when None)."""
        if any(t.tier == tier.tier for t in self._tiers):
            raise ValueError(f"a tier named {tier.tier!r} is registered already")
        at = len(self._tiers) if after is None else self.depth(self[after]) + 1
        if self._on_register is not None:
            self._on_register(tier)
        # a new list: a restore or a commit going through the old one meanwhile is not upset
        self._tiers = [*self._tiers[:at], tier, *self._tiers[at:]]

    def __iter__(self) -> Iterator[ColdTier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def __getitem__(self, name: str) -> ColdTier:
        for t in self._tiers:
            if t.tier == name:
                return t
        raise KeyError(name)

    def depth(self, tier: ColdTier) -> int:
        """The tier's place in the order, 0 for the nearest (L2)."""
        return self._tiers.index(tier)


class ChunkCatalog:
    def __init__(
        self,
        identity: CacheIdentity,
        directory: ChunkDirectory,
        tiers: ColdTiers,
        counters: Counters,
        *,
        published: bool,
        shared_keys: Container[bytes] | None = None,
    ) -> None:
        self.identity = identity
        self.directory = directory
        self.tiers = tiers
        self.counters = counters
        # some prefix is published to every tenant (also found in L3 at start)
        self._published = published
        # keys of chunks a shared tier holds, some published on another host (L4's known keys)
        self._shared_keys = shared_keys

    def mark_published(self) -> None:
        """From now on shared keys are looked for (before any shared key exists)."""
        self._published = True

    def key_for(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes:
        """Key of a full chunk: the shared namespace's if that prefix was published."""
        return self.keyed(parent, toks, s)[0]

    def keyed(self, parent: bytes, toks: Sequence[int], s: Session) -> tuple[bytes, bool]:
        """`key_for`, and whether the key is the shared namespace's. A shared key is looked for
        only where one can exist: something was published into this store (also set from L3
        at start), or another host's may be in a shared tier. Otherwise the session's own key
        is the only one, and one hash instead of two (a restore hashes every chunk)."""
        remote = self._shared_keys
        if self._published or remote is not None:
            shared = chunk_key(parent, toks, self.identity.shared_ns)
            d = self.directory
            if d.get(shared) is not None or (self._published and d.in_l3(shared)):
                return shared, True
            if remote is not None and shared in remote:  # published on another host
                return shared, True
        return chunk_key(parent, toks, s.ns), False

    def tail_key(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes:
        """Key of the session's partial tail (the tokens after its last full chunk): always the
        session's own namespace, as a tail is the session's alone (never published)."""
        return chunk_key(parent, toks, s.ns)

    def locate(self, key: bytes, parent: bytes = ZERO_KEY) -> tuple[Chunk | None, ColdTier | None]:
        """The nearest tier that holds `key` and its entry (None, None: none does). L2 holds it
        in a ready slot, or in one a read in flight fills (the restore waits for it outside the
        lock); a chunk not ready in L2 counts an L2 miss, wherever it is found. Never waits."""
        d = self.directory
        e = d.get(key)
        if e is not None and e.l3_read is not None and e.l3_read.done():
            d.settle_read(e, e.l3_read)
        if not d.in_l2(key):
            self.counters.misses[Tier.L2] += 1
        for t in self.tiers:
            tokens = t.holds(key)
            if tokens:
                return d.ensure(key, parent, tokens), t
        return None, None

    def segments(self, s: Session, want: Ids, base: int) -> list[Segment]:
        """The chunks of `want` after its first `base` tokens (a multiple of the chunk size,
        kept in L1) that the tiers hold, in order, each with the tier it is nearest in: full
        chunks by key, and the session's own stored partial tail where its prefix ends. The
        prefix ends at the first chunk no tier holds: a miss of every tier past L2."""
        C = self.identity.chunk_tokens
        out: list[Segment] = []
        parent = s.chunk_keys[-1] if base else ZERO_KEY
        tail = len(s.tokens) % C if s.tail_key is not None else 0
        for i in range(base // C, len(want) // C + 1):
            toks = want[i * C : (i + 1) * C]
            entry: Chunk | None = None
            tier: ColdTier | None = None
            if len(toks) == C:
                key, shared = self.keyed(parent, toks, s)
                entry, tier = self.locate(key, parent)
                if entry is not None and not entry.tenant:  # found in L3: whose is it (shred)?
                    entry.tenant = SHARED_TENANT if shared else s.tenant
            if (
                entry is None
                and tail
                and len(toks) >= tail
                and self.tail_key(parent, toks[:tail], s) == s.tail_key
            ):
                # the session's own hibernated partial tail, at the end of its stored prefix
                entry, tier = self.locate(s.tail_key, parent)
                if entry is not None and not entry.tenant:
                    entry.tenant = s.tenant
            if entry is None or tier is None:
                for t in self.tiers:
                    if t.tier != Tier.L2:  # L2's misses are counted per chunk (`locate`)
                        self.counters.misses[t.tier] += 1
                break
            out.append((tier, entry))
            parent = entry.key
            if entry.tokens < C:
                break
        return out

    def held(self, key: bytes) -> bool:
        """Whether a cold tier holds the chunk `key` (without counting a hit or a miss)."""
        return any(t.holds(key) for t in self.tiers)

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
        """Start L3 -> L2 reads of the session's chunks (never waits). L3's alone: a tier read
        in batches (L4) is read when a restore asks for the chunks."""
        for key in [*s.chunk_keys] + ([s.tail_key] if s.tail_key else []):
            e, tier = self.locate(key)
            if e is None or tier is None:
                break
            if tier.tier == Tier.L3 and tier.start_read(e, TierReads(tier)) is None:
                break
