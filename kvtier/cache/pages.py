"""Sessions whose L1 is pages of the caller's page pool: `Session.restore(ids, pool=pool)`.

The library's side of paged L1 (the server's is its batch scheduler). The session's K/V lives in
a page table of `pool` (`kvtier.paged.PagePool`), and `restore` returns a transformers `Cache`
over it (`kvtier.integrations.paged_cache.PagedCache`):

- **restore**: the session's own pages in that pool are kept in place when they hold a prefix
  of the ids that its stored tokens also cover (no copy; the source is `l1`). Otherwise a staged
  restore lands the stored prefix in new pages straight from L2 (L3 read into L2 first), one
  copy per chunk (`TieredCache.restore_staged`, `load_staged`), and no L1 buffer is taken.
- **forward**: each layer writes its new K/V into the pages. Room comes from free pages, then
  from other idle sessions' pages in the same pool, least recently active first (those are then
  hibernated: everything they committed is stored already).
- **commit**: the turn's new chunks go from the pages to L2 (and L3, by the write policy) with
  `commit_pages`, each gathered from the pages only when it is stored, within the bound of
  copies in flight (`CacheConfig.inflight_bytes_max`); the pages stay the session's.
- **abort, hibernate, close**, and the cache's `close`: the pages go back to the pool.

Native codec and a native pool only: the pages are the exact K/V the model computed.
Every change to the pool's page tables happens under the cache's lock, so sessions on
different threads may share one pool.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.restoreplan import StagedPrefix, common_prefix
from kvtier.errors import ConfigError, SessionError
from kvtier.integrations.paged_cache import PagedCache
from kvtier.paged.pool import PagedSequence, PagePool, PoolExhausted
from kvtier.types import RestoreSource, SessionState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.catalog import ChunkCatalog
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.lifecycle import SessionLifecycle
    from kvtier.cache.records import SessionRecords
    from kvtier.cache.restore import Restorer
    from kvtier.cache.session import Ids, Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.cache.stats import Counters


@dataclass(eq=False, kw_only=True)
class PoolSessions:
    """The sessions restored into callers' page pools; the owner of their `PagedCache`s."""

    guard: CacheGuard
    identity: CacheIdentity
    counters: Counters
    table: SessionTable
    records: SessionRecords
    catalog: ChunkCatalog
    restorer: Restorer
    lifecycle: SessionLifecycle

    def check_pool(self, pool: PagePool) -> None:
        """Refuse a pool the session's K/V cannot live in."""
        ident = self.identity
        if not isinstance(pool, PagePool):
            raise ConfigError(f"pool must be a kvtier.paged.PagePool, got {type(pool).__name__}")
        if pool.quantized:
            raise ConfigError(
                "an int8 page pool holds approximate K/V; restore into a pool with "
                "kv_dtype='native'"
            )
        # the shape must be the model's; the dtype is the pool's (`dtype`, checked next),
        # whatever the config says (a model moved to bfloat16 keeps a float32 config)
        if dataclasses.replace(pool.geometry, dtype=ident.geometry.dtype) != ident.geometry:
            raise ConfigError(
                f"the pool's geometry ({pool.geometry}) is not the model's ({ident.geometry}); "
                "build the pool with KVGeometry.from_config(model.config)"
            )
        if pool.dtype != ident.geometry.torch_dtype():
            raise ConfigError(
                f"the pool holds {pool.dtype}, the model computes {ident.geometry.dtype}; build "
                "the pool with dtype=<the model's parameter dtype>"
            )
        if not ident.codec.lossless:
            raise ConfigError(
                f"codec {ident.config.codec!r} stores approximate K/V; a session in a page pool "
                "commits its pages as they are: use codec='native'"
            )

    def restore(self, s: Session, ids: Ids, pool: PagePool) -> PagedCache:
        """`Session.restore(ids, pool=pool)`: see the module doc."""
        self.check_pool(pool)
        if not ids:
            raise SessionError("restore needs at least one input token")
        t0 = time.perf_counter()
        with self.guard:
            self.restorer.check_restorable(s)
            view = s.pages
            if view is not None and view.pool is pool and s.state is SessionState.IDLE:
                n = min(view.table.length, common_prefix(s.tokens, ids[:-1]))
                if n > 0 and not self.catalog.tiers_extend(s, ids[:-1], n, whole=True):
                    s.truncate(n)
                    s.begin_turn()
                    self.counters.hits[Tier.L1.value] += 1
                    self.counters.restored_tokens[Tier.L1.value] += n
                    self.restorer.count(s, RestoreSource.L1.value, t0)
                    _trim(pool, view.table, n)
                    return self._view(s, pool, view.table)
            s.drop_pages()
            if s.resident:  # in L1 buffers from a restore without a pool: store it, free them
                self.lifecycle.hibernate(s, wait=False)
        out = self.restorer.restore_staged(s, ids)  # active from here; the prefix pinned in L2
        assert not s.resident
        staged = out if isinstance(out, StagedPrefix) else None
        table = PagedSequence()
        try:
            covered = staged.tokens if staged is not None else 0
            view = self._view(s, pool, table)
            self.reserve_pages(view, covered)
            if staged is not None:

                def write(first: int, chunks: object) -> None:
                    pool.write_chunks(table.pages, first, chunks)  # type: ignore[arg-type]

                self.restorer.load_staged(s, staged, write).wait(spin=True)
                table.length = covered
                view.lengths[:] = [covered] * len(view.lengths)
        except BaseException:
            with self.guard:
                pool.release(table)
                s.pages = None
            self.lifecycle.abort(s)
            raise
        finally:
            self.restorer.release_staged(s, staged)
        return view

    def _view(self, s: Session, pool: PagePool, table: PagedSequence) -> PagedCache:
        """The session's Cache over `table`; the chunk its commit starts storing from."""
        view = PagedCache(self, pool, table)
        s.pages = view
        C = self.identity.chunk_tokens
        s.pages_start = table.length // C * C
        return view

    def reserve_pages(self, view: PagedCache, tokens: int) -> None:
        """Room in `view`'s table for `tokens` tokens in all (`PageOwner.reserve_pages`): free
        pages first, then the pages of other idle sessions in the pool, least recently active
        first; `PoolExhausted` when that is not enough."""
        pool, table = view.pool, view.table
        with self.guard:
            while not pool.reserve(table, max(0, tokens - table.length)):
                idle = [
                    o
                    for o in self.table.values()
                    if o.pages is not None
                    and o.pages is not view
                    and o.pages.pool is pool
                    and o.state is SessionState.IDLE
                ]
                if not idle:
                    raise PoolExhausted(
                        pool.pages_needed(table, tokens - table.length), pool.num_free
                    )
                victim = min(idle, key=lambda o: (o.pinned, o.last_active))
                victim.drop_pages()
                victim.hibernated()  # committed with commit_pages: stored
                self.counters.evictions[Tier.L1.value] += 1
                self.records.save(victim)

    def commit(self, s: Session, ids: Ids) -> None:
        """`Session.commit(ids)` of a session restored into a pool: its new chunks go from the
        pages to L2 (`commit_pages`), the pages stay its own."""
        view = s.pages
        assert view is not None
        C = self.identity.chunk_tokens
        with self.guard:
            if s.state is not SessionState.ACTIVE:
                raise SessionError("commit() must follow restore() on the same session")
            n = min(min(view.lengths), len(ids))
            start = min(s.pages_start, n // C * C)
            pages = view.table.pages
            # gathered one at a time as each is stored, never all of a long turn's at once
            gather = view.pool.gather
            chunks = [
                functools.partial(gather, pages, a, min(a + C, n)) for a in range(start, n, C)
            ]
            self.lifecycle.commit_pages(s, ids[:n], start, chunks)
            _trim(view.pool, view.table, n)
            view.lengths[:] = [n] * len(view.lengths)


def _trim(pool: PagePool, table: PagedSequence, n: int) -> None:
    """Keep the first `n` tokens of `table`: the pages past them go back to the pool."""
    keep = pool.pages_for(n)
    if keep < len(table.pages):
        pool.free(table.pages[keep:])
        del table.pages[keep:]
    table.length = min(table.length, n)
