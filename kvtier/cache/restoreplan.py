"""The plain data of a restore: its plan, a staged prefix, and the common-prefix test."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.coldtier import ColdTier
    from kvtier.cache.directory import Chunk
    from kvtier.cache.session import Ids


@dataclass(eq=False)
class TierReads:
    """One restore's reads through one cold tier: the plan's segments the tier loaded (read, or
    found ready in an L2 slot), how many of its reads failed, and the tier's own record of them."""

    tier: ColdTier
    segments: list[int] = field(default_factory=list)  # indices into the plan's segments
    failed: int = 0  # reads that ended in an exception (set when they are settled)
    own: Any = None  # the tier's own record of them (L4: the pending batch of its reads)


@dataclass
class RestorePlan:
    want: Ids
    segments: list[tuple[ColdTier, Chunk]]  # each chunk of the prefix and the tier it was in
    reads: dict[int, Future[Any]] = field(default_factory=dict)  # segment index -> its read
    # the segments each tier loaded, by the tier's name: read through it (a read in flight
    # that this plan joins is its reader's), or found ready in L2 (L2's)
    by_tier: dict[str, TierReads] = field(default_factory=dict)
    usable: int = 0  # leading segments whose bytes reached L1
    base: int = 0  # tokens kept in L1 before the first segment (its chunks are the session's)
    t_read: float = 0.0  # waiting for the reads, and the read throttle
    t_copy: float = 0.0  # the L2 -> L1 copy

    def reads_of(self, tier: ColdTier) -> TierReads:
        """This plan's reads through `tier` (made on first use)."""
        r = self.by_tier.get(tier.tier)
        if r is None:
            r = self.by_tier[tier.tier] = TierReads(tier)
        return r


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
