"""The pages of the batch's turns: admission into the pool, preemption out of it, the way out.

`TurnPages` is the scheduler's page manager: it gives an admitted turn pages for all its known
tokens and copies its cached K/V in (or takes its session's parked pages, or shares a running
turn's prefix pages: `kvtier.server.pages.parking.PageTables`), moves a preempted turn's K/V out of
the pool, and gathers a finished turn's new K/V for its commit. What runs, and when a turn is
admitted or preempted, is the scheduler's decision (kvtier/server/batch/batching.py); this module
only carries it out on the pages.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.cache.restore import StagedPrefix
from kvtier.paged import PagedSequence, PagePool
from kvtier.server.pages.loading import StagedLoader
from kvtier.server.pages.pagecopy import append_kv, copy_in, copy_out
from kvtier.server.pages.parking import PageTables, Parked, key_of

if TYPE_CHECKING:
    from kvtier.server.batch.turn import Turn


class TurnPages:
    def __init__(
        self,
        pool: Callable[[], PagePool],
        tables: PageTables,
        loader: StagedLoader,
        running: list[Turn],
        waiting: deque[Turn],
        fail: Callable[[Turn, BaseException], None],
        count: Callable[[str, int], None],
        *,
        paged_l1: bool,
        chunk_tokens: int,
    ) -> None:
        self.pool = pool  # the scheduler's pool (a device failover replaces it)
        self.tables = tables
        self.loader = loader
        self.running = running
        self.waiting = waiting
        self._fail = fail
        self._count = count
        self.paged_l1 = paged_l1
        self.chunk_tokens = chunk_tokens
        self.preemptions = 0  # sequences moved out of the pool to make room
        self.parked_turns = 0  # turns admitted from their session's parked pages
        self.shared_pages = 0  # pages taken from a running sequence at admission, in all
        # pages finished turns' commits hold while they store them (`chunks_out`), handed back
        # from the commit threads (`hand_back`) and freed on the scheduler's (`release_held`)
        self._back = threading.Condition(threading.Lock())
        self._handed: list[CommitPages] = []
        self.holding = 0  # commits holding pages now

    def admit(self, s: Turn, shared: list[int] | None = None, own: Parked | None = None) -> bool:
        """Give a waiting sequence pages for all its known tokens and copy in its cached K/V;
        `shared` (from `PageTables.shareable`) are full pages of its cached prefix that it
        shares; `own` (from `PageTables.own_pages`) its session's parked pages, which hold that
        K/V already."""
        s.trace.admitting(self.pool().device, s.stream.clock)
        stale = self.tables.current().pop(key_of(s), None)
        if own is not None:
            assert stale is own
            seq, stale = own.table, None
            self.tables.trim(seq, s.cached)
            s.unclaim()
            self.parked_turns += 1
            self._count("parked_turns", 1)
        else:
            seq = PagedSequence()
            if shared:
                seq.pages = self.pool().share(shared)
                seq.length = len(shared) * self.pool().page_size
        ok = self.pool().reserve(seq, len(s.tokens) - seq.length)
        assert ok, "free pages were counted above"
        if stale is not None:  # a new turn of the session: its older pages go
            self.tables.free(stale.table)
        try:
            if s.cached > seq.length:
                assert s.restored is not None
                if s.spilled is not None:  # preempted (paged L1): its K/V comes back
                    self.pool().scatter(seq.pages, seq.length, s.spilled[:, :, seq.length :])
                elif isinstance(s.restored.kv, StagedPrefix):  # paged L1: L2 -> pages
                    self.loader.start(s, seq, self.pool())
                else:
                    copy_in(self.pool(), s.restored.kv, seq, seq.length, s.cached)
                s.trace.copied_in()
        except BaseException as exc:
            self.tables.free(seq)
            self._fail(s, exc)
            return False
        seq.length = s.cached
        s.run_in(seq)
        self.running.append(s)
        if shared:
            self.shared_pages += len(shared)
            self._count("shared_kv_pages", len(shared))
        if s.loading is None:  # else once it is loaded
            self.tables.register(s, seq)
        return True

    def release(self, s: Turn) -> None:
        """`s` leaves the pool: drop its reference to each page (a shared page stays)."""
        if s.loading is not None:
            self.loader.finish(s)
        if s.paged is not None:
            self.tables.free(s.paged)
            s.paged = None

    def copy_out(self, s: Turn) -> torch.Tensor | None:
        """K/V of tokens [cached, fed) from the pages (nothing from an int8 pool)."""
        assert s.paged is not None
        return copy_out(self.pool(), s.paged, s.cached)

    def preempt(self, s: Turn) -> None:
        """Move a running sequence's K/V into its session's Cache, free its pages, requeue it."""
        self.running.remove(s)
        failed = self.loader.finish(s) if s.loading is not None else None  # the gather reads it
        if failed is not None:
            self._fail(s, failed)
            return
        spilled = None
        try:
            assert s.restored is not None and s.paged is not None
            if self.paged_l1:  # no Cache to take it: it waits beside the pool, in host memory
                spilled = self.pool().to_host(s.paged.pages, 0, s.paged.length)
            else:
                new = self.copy_out(s)
                if new is not None:
                    append_kv(s.restored.kv, new)
        except BaseException as exc:
            self._fail(s, exc)
            return
        # an int8 pool's K/V is not in a Cache: those tokens are recomputed
        s.preempt(spilled, kept=not self.pool().quantized or spilled is not None)
        self.preemptions += 1
        self.release(s)
        self.waiting.appendleft(s)

    def chunks_out(self, s: Turn) -> CommitPages | None:
        """Paged L1: what a finished turn's commit stores, from the chunk its restored prefix
        ends in to its last fed token. Nothing is gathered here: the commit gathers each chunk
        when it stores it, into a gather buffer of the cache's (`TieredCache.commit_pages`),
        from pages this holds a reference to until the commit hands them back
        (`CommitPages.pages`, freed with `release_held`). None from an int8 pool."""
        if s.paged is None or self.pool().quantized:
            return None
        assert s.restored is not None
        pool, C = self.pool(), self.chunk_tokens
        start = s.restored.covered // C * C
        end = s.paged.length
        held = pool.share(s.paged.pages[: pool.pages_for(end)])
        self.holding += 1
        chunks = [
            functools.partial(pool.gather, held, a, min(a + C, end)) for a in range(start, end, C)
        ]
        return CommitPages(start, chunks, pool, held)

    def hand_back(self, pages: CommitPages) -> None:
        """(Any thread) a commit is done with the pages it held."""
        with self._back:
            self._handed.append(pages)
            self._back.notify_all()

    def release_held(self) -> int:
        """(The scheduler's thread) free the pages commits handed back: a page no table holds
        any more is free again; pages of a pool a failover replaced went with it. Returns how
        many commits handed theirs back."""
        if not self._handed:  # every step asks: no lock while nothing came back
            return 0
        with self._back:
            done, self._handed = self._handed, []
        for c in done:
            self.holding -= 1
            if c.pool is not self.pool():
                continue
            if c.copied is not None:  # the gathers were issued on a commit thread's stream
                torch.cuda.current_stream(c.pool.device).wait_event(c.copied)
            self.tables.free(PagedSequence(pages=c.pages))
        return len(done)

    def await_held(self, timeout: float = 1.0) -> bool:
        """The pool is full: wait (at most `timeout` s) for a commit to hand back the pages it
        holds, rather than preempt a turn or cut a reply short for room that is on its way
        back (backpressure from commits waiting for L2). Whether any came back."""
        if self.holding == 0:
            return False
        with self._back:
            self._back.wait_for(lambda: bool(self._handed), timeout)
        return self.release_held() > 0


@dataclasses.dataclass(eq=False)
class CommitPages:
    """A finished turn's K/V on its way to the cache: `chunks[j]` gathers tokens
    `[start + j*C, ...)` from `pages` (held for the commit) into the buffer it is given."""

    start: int
    chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]]
    pool: PagePool
    pages: list[int]
    copied: torch.cuda.Event | None = None  # recorded after the last gather (CUDA)
