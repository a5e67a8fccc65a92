"""ColdTier: what the cache asks of a tier below L1.

Every tier below L1 is a `ColdTier`: L2 (the chunk directory's slots in the host arena,
kvtier.cache.tierset), L3 (the SSD store, tierset) and L4 (the shared Redis tier, `SharedTier`
in kvtier.cache.l4). A restore asks the tiers in the registry's order, nearest first, which one
holds each chunk of the prefix (`ChunkCatalog.segments`), starts the reads of those it does not
find ready in L2 (every read lands in an L2 slot), and once they are done tells each tier what
it loaded (`observe`). A chunk stored in L2 is handed to every tier in turn (`write`).

The cache keeps its tiers in one ordered registry, `ColdTiers` (kvtier.cache.catalog), and a
restore's reads through each in `TierReads` (kvtier.cache.restoreplan). Adding a tier is one
class with these methods and one `ColdTiers.register` call: the restore and the commit code go
through the registry, never through a tier by name.

Pure: no tier, no torch, no I/O (the import contracts hold it).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.directory import Chunk
    from kvtier.cache.restoreplan import TierReads


class ColdTier(Protocol):
    """A tier below L1 that holds chunks by key and reads them into L2 slots. The cache calls
    every method with its guard held; none waits."""

    @property
    def tier(self) -> str:
        """The tier's name: its `tier` metric label and the restore source it gives. The built-in
        tiers' are the values of `kvtier.types.Tier`."""
        ...

    def holds(self, key: bytes) -> int | None:
        """How many tokens the chunk `key` has if this tier holds it (as far as the cache knows
        now: a read may still find it gone), else None. Counts nothing."""
        ...

    def start_read(self, e: Chunk, reads: TierReads) -> Future[Any] | None:
        """Start filling an L2 slot with chunk `e` from this tier (through
        `ChunkDirectory.start_fetch`, which reserves the slot and tracks the read). `reads`:
        this restore's reads from the tier, where a tier that reads in batches keeps them until
        `launch`. Returns the read's future (its exception: the chunk is not usable), or None
        when L2 has no slot free (the restore loads the prefix before `e`)."""
        ...

    def launch(self, reads: TierReads, tenant: str) -> None:
        """Start the reads that `start_read` registered for one restore of `tenant`'s session;
        called once per restore, whatever happened, so every registered read settles."""
        ...

    def write(self, e: Chunk) -> None:
        """Chunk `e` was just stored in its L2 slot (its bytes may still be on their way there:
        order any copy after the slot's): keep it, or a copy of it, as this tier does."""
        ...

    def observe(self, reads: TierReads, nbytes: int, t_read: float, t_copy: float) -> None:
        """A restore loaded `nbytes` of its usable prefix through this tier's reads (`reads`,
        whose `failed` ones were not usable): `t_read` waiting for the reads (and the read
        throttle), `t_copy` its share of the L2 -> L1 copy. For the tier's counters and the cost
        model's estimate of it."""
        ...
