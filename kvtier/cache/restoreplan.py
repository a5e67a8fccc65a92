"""The plain data of a restore: its plan, a staged prefix, and the common-prefix test."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.types import RestoreSource

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.directory import Chunk
    from kvtier.cache.session import Ids


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


# The deepest source of a restore names it (`restore_source`).
DEPTH = {RestoreSource.RECOMPUTE.value: 0, "l1": 1, "l2": 2, "l3": 3, "l4": 4}
