"""The batch pool's page tables between turns: parked tables and the prefix-page index.

A finished turn's pages stay in the pool as its session's (`park_pages`; with paged L1 they are
the session's L1): its next turn starts from them instead of a copy of its restored prefix. They
go, least recently parked first, when an admission needs the room. Full pages of a running
sequence's cached prefix are indexed by content (`kvtier.server.pages.pageshare`), so that a turn of
the same tenant with the same leading tokens shares them instead of copying.

Both name pages of one pool: when a device failover rebuilds the pool they start empty. The
scheduler thread alone uses `PageTables`, but for `Parked.claimed`, which changes only under
the scheduler's condition (restore threads claim a session's table through it).
"""

from __future__ import annotations

import dataclasses
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from kvtier.paged import PagedSequence, PagePool
from kvtier.server.pages.pageshare import PrefixPages, page_keys
from kvtier.types import RestoreSource

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.turn import Turn


class Key(NamedTuple):
    """A session's key in the page tables."""

    tenant: str
    session_id: str


@dataclasses.dataclass(eq=False)
class Parked:
    """A finished turn's pages, kept in the pool for its session's next turn (`park_pages`)."""

    table: PagedSequence  # `length`: the tokens whose K/V the pages hold
    tokens: array[int]  # those tokens' ids
    claimed: bool = False  # paged L1: a restored turn of the session starts from them


def key_of(s: Turn) -> Key:
    return Key(s.job.tenant, s.job.session_id)


class PageTables:
    """Parked tables (least recently parked first) and the prefix-page index of `pool` (a
    failover replaces it: `replace_pool`). With paged L1 a parked table freed to make room is
    its session's L1 going: `take_dropped` hands those sessions' keys over, for the cache."""

    def __init__(
        self,
        pool: PagePool,
        cond: threading.Condition,
        *,
        park: bool,
        share: bool,
        paged_l1: bool,
    ) -> None:
        self.pool = pool
        self._cond = cond
        self.park_pages = park
        self.share_prefixes = share
        self.paged_l1 = paged_l1
        self.parked: OrderedDict[Key, Parked] = OrderedDict()
        self.prefixes = PrefixPages(pool)
        self._state_pool: PagePool | None = pool  # the pool the two above belong to
        self._dropped: list[Key] = []  # paged L1: sessions whose parked table went

    def replace_pool(self, pool: PagePool) -> None:
        """The pool the tables name from now on; they are emptied at their next use."""
        self.pool = pool

    @property
    def stale(self) -> bool:
        """Whether the pool was replaced since the tables were last used."""
        return self._state_pool is not self.pool

    def current(self) -> OrderedDict[Key, Parked]:
        """The parked tables of the current pool (emptied when a failover rebuilt it)."""
        if self.stale:
            self.prefixes = PrefixPages(self.pool)
            if self.paged_l1:
                self._dropped.extend(self.parked)
            self.parked.clear()
            self._state_pool = self.pool
        return self.parked

    def take_dropped(self) -> list[Key]:
        """Paged L1: the sessions whose parked tables went since the last call (every
        scheduler iteration asks: no new list while none went)."""
        if not self._dropped:
            return []
        dropped, self._dropped = self._dropped, []
        return dropped

    def pages(self) -> int:
        """Pages the parked tables hold (a page tables share counts once)."""
        return len({p for t in self.parked.values() for p in t.table.pages})

    def park(self, s: Turn) -> bool:
        """Keep a finished turn's pages as its session's; False where they may not stay: parking
        off, an ephemeral session, an int8 pool (its pages are approximate, and the session's
        Cache did not take them)."""
        table = s.paged
        if not self.park_pages or table is None or s.job.ephemeral or self.pool.quantized:
            return False
        parked = self.current()
        old = parked.pop(key_of(s), None)
        if old is not None:
            self.free(old.table)
        parked[key_of(s)] = Parked(table, array("q", s.tokens[: table.length]))
        return True

    def drop(self, keys: Iterable[Key]) -> None:
        """Free these sessions' parked tables, but those a turn on its way in has claimed."""
        for key in keys:
            p = self.current().get(key)
            if p is not None and not p.claimed:
                del self.parked[key]
                self.free(p.table)

    def own_pages(self, s: Turn) -> Parked | None:
        """`s`'s session's parked pages when they hold exactly its restored prefix: restored
        from L1 (what the last turn committed, whose pages these are), the same ids, and no
        page it will write held by another table."""
        if s.held is not None:  # paged L1: claimed at restore, nothing freed them since
            return s.held if self.current().get(key_of(s)) is s.held else None
        if not self.parked:
            return None
        p = self.current().get(key_of(s))
        if p is None or s.restored is None or s.restored.source != RestoreSource.L1.value:
            return None
        n = s.cached
        if n > p.table.length or p.tokens[:n] != array("q", s.tokens[:n]):
            return None
        first = n // self.pool.page_size
        if any(self.pool.refcount(page) > 1 for page in p.table.pages[first:]):
            return None
        return p

    def pages_wanted(self, s: Turn, own: Parked | None, running: bool) -> tuple[int, list[int]]:
        """Free pages `s`'s admission takes, and the pages it shares (see the scheduler's
        `Pages.admit`); `running`: whether any sequence runs (holds pages to share)."""
        if own is not None:  # pages past `cached` go; a shared page at `cached` is copied
            self.trim(own.table, s.cached)
            return self.pool.pages_needed(own.table, len(s.tokens) - s.cached), []
        shared = self.shareable(s) if running else []
        return self.pool.pages_for(len(s.tokens)) - len(shared), shared

    def trim(self, table: PagedSequence, n: int) -> None:
        """Keep a parked table's first `n` tokens for a new turn: the pages past them go, and
        the prefix index forgets the keys of those from `n` on (they are written again)."""
        size = self.pool.page_size
        keep = self.pool.pages_for(n)
        if keep < len(table.pages):
            self.free(PagedSequence(pages=table.pages[keep:]))
            del table.pages[keep:]
        self.index().drop(table.pages[n // size :])
        table.length = min(table.length, n)

    def unpark(self, pages: int, waiting: Iterable[Turn], keep: Parked | None = None) -> bool:
        """Free parked tables, least recently parked first (not `keep`, nor a table a restored
        turn has claimed), until `pages` more pages are free; then the claimed tables of the
        `waiting` turns, latest first. Whether that many are free."""
        parked = self.current()
        goal = self.pool.num_free + pages
        for key in list(parked):
            if self.pool.num_free >= goal:
                break
            with self._cond:
                if parked[key] is keep or parked[key].claimed:
                    continue
                table = parked.pop(key).table
            self.free(table)
            if self.paged_l1:  # the session is in L2/L3 alone now
                self._dropped.append(key)
        for s in reversed(list(waiting)):  # claimed tables: their turns wait beside the pool
            if self.pool.num_free >= goal:
                break
            if s.held is not None and s.held is not keep:
                self.spill(s)
        return self.pool.num_free >= goal

    def spill(self, s: Turn) -> None:
        """A waiting turn gives up its claimed parked table: the K/V of its cached prefix waits
        beside the pool in host memory (as a preempted turn's does), outside the GPU memory
        budget, and goes back in when it is admitted. (A copy on the GPU beside the pool ran a
        24 GiB server out of memory.)"""
        p = s.unclaim()
        if p is None or self.current().get(key_of(s)) is not p:
            return
        s.spill(self.pool.to_host(p.table.pages, 0, s.cached))
        del self.parked[key_of(s)]
        self.free(p.table)

    def free(self, table: PagedSequence) -> None:
        """Give a table's pages back; the prefix index forgets those no other table holds."""
        self.index().drop(table.pages)
        self.pool.release(table)

    # ---- shared prefix pages (kvtier.server.pages.pageshare) ----------------------------------------

    def sharing(self) -> bool:
        """Whether admissions share prefix pages now: not from an int8 pool (degraded mode)."""
        return self.share_prefixes and not self.pool.quantized

    def index(self) -> PrefixPages:
        """The prefix-page index of the current pool."""
        self.current()
        return self.prefixes

    def page_keys(self, s: Turn) -> list[bytes]:
        """Content keys of the full pages of `s`'s cached prefix (tenant and token ids)."""
        size = self.pool.page_size
        if s.keys is None or s.keys[:2] != (s.cached, size):
            keys = page_keys(s.job.tenant, s.tokens, size, s.cached // size)
            s.keys = (s.cached, size, keys)
        return s.keys[2]

    def shareable(self, s: Turn) -> list[int]:
        """Pages a running sequence holds for the longest run of `s`'s leading full cached
        pages (the same tenant and tokens from position 0)."""
        if s.cached < self.pool.page_size or not self.sharing():
            return []
        return self.index().lookup(self.page_keys(s))

    def register(self, s: Turn, table: PagedSequence) -> None:
        """`s`'s full prefix pages in `table` may be shared from now on (when sharing)."""
        if self.sharing():
            self.index().register(self.page_keys(s), table)
