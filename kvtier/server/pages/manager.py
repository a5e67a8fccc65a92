"""The page manager: every page of the batch's pool a turn or a session holds, behind one face.

`Pages` is what the scheduler talks to. Its verbs:

- `plan_admission(turn, reserved, sharing)`: whether a waiting turn fits now, freeing parked
  tables for it where that makes room; an `Admission` (its session's parked pages to start from,
  or the running turns' prefix pages it shares), or None while it does not fit;
- `admit(turn, admission)`: its pages, and its cached K/V in them (copied, scattered back from
  host memory, or staged from L2 by the loader);
- `preempt(turn)`: its K/V out of the pool and its pages freed; `release(turn)`: its pages freed;
- `park(turn)`: a finished turn's pages kept as its session's; `chunks_out(turn)` and
  `copy_out(turn)`: what its commit stores;
- `make_room(pages, waiting)`, `await_held()`, `release_held()`: room from parked tables and
  from the pages commits hand back.

Inside: the parked tables and the prefix-page index (`parking.PageTables`, `pageshare`), the
copies between a Cache and the pages (`pagecopy`), and the loader of staged prefixes
(`loading.StagedLoader`). What runs, and when a turn is admitted or preempted, is the
scheduler's decision (kvtier/server/batch/scheduler.py); this package carries it out.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.cache.restore import StagedPrefix
from kvtier.errors import ContextExceeded, KvtierError
from kvtier.paged import PagedSequence, PagePool
from kvtier.server.backend import PagedBackend
from kvtier.server.pages.loading import StagedLoader
from kvtier.server.pages.pagecopy import append_kv, copy_in, copy_out
from kvtier.server.pages.parking import Key, PageTables, Parked, key_of

if TYPE_CHECKING:
    from kvtier.server.batch.turn import Turn


def pool_too_small(tokens: int, capacity: int) -> ContextExceeded:
    """A conversation longer than the batch's page pool holds (`capacity` tokens)."""
    return ContextExceeded(
        f"the conversation has {tokens} tokens but the batch KV pool holds {capacity}; shorten "
        "it, or raise batch_kv_bytes (or turn batching off)"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Admission:
    """How a waiting turn enters the pool: from its session's parked pages (`own`), or with
    fresh pages of which the first `shared` are a running turn's prefix pages."""

    own: Parked | None
    shared: list[int]
    start: int  # the tokens of its cached prefix those pages hold; the rest is copied in


class Pages:
    """The batch's page manager (see the module docstring). `pool` is the pool it manages (a
    device failover replaces it: `replace_pool`); `cond` is the scheduler's condition, under
    which restore threads claim parked tables; `paged` is the cache behind the pool with paged
    L1, where the pool is the sessions' L1."""

    def __init__(
        self,
        pool: PagePool,
        cond: threading.Condition,
        paged: PagedBackend | None,
        count: Callable[[str, int], None],
        *,
        park: bool,
        share: bool,
        chunk_tokens: int,
    ) -> None:
        self.pool = pool
        self._cond = cond
        self.paged_l1 = paged is not None
        self.tables = PageTables(pool, cond, park=park, share=share, paged_l1=self.paged_l1)
        self.loader = StagedLoader(paged, self.tables)
        self._count = count
        self.chunk_tokens = chunk_tokens
        self.preemptions = 0  # turns moved out of the pool to make room
        self.parked_turns = 0  # turns admitted from their session's parked pages
        self.shared_pages = 0  # pages taken from a running turn at admission, in all
        self._dropping: list[Key] = []  # parked tables to free (`drop_parked`), under `cond`
        # pages finished turns' commits hold while they store them (`chunks_out`), handed back
        # from the commit threads (`hand_back`) and freed on the scheduler's (`release_held`)
        self._back = threading.Condition(threading.Lock())
        self._handed: list[CommitPages] = []
        self.holding = 0  # commits holding pages now

    def replace_pool(self, pool: PagePool) -> None:
        """A device failover rebuilt the pool: the parked tables and the prefix index of the
        old one go with it (their sessions, with paged L1, are in L2/L3 alone now)."""
        self.pool = pool
        self.tables.replace_pool(pool)

    # ---- admission ----------------------------------------------------------------------------

    def plan_admission(
        self, s: Turn, reserved: int, sharing: bool, waiting: Iterable[Turn]
    ) -> Admission | None:
        """Whether the waiting turn `s` fits now, beside `reserved` free pages the running
        turns take this step; parked tables (not its own) go to make room, least recently parked
        first, then claimed tables of the `waiting` turns. `sharing`: a turn runs whose prefix
        pages it may share. None while it does not fit; raises a `KvtierError` when it never
        will (the turn fails, the others go on)."""
        pool = self.pool
        if pool.pages_for(len(s.tokens)) > pool.num_pages:
            raise pool_too_small(len(s.tokens), pool.num_pages * pool.page_size)
        own = self.tables.own_pages(s)
        if s.held is not None and own is None:  # a device failover rebuilt the pool
            raise KvtierError("the session's K/V pages were lost; send it again")
        want, shared = self.tables.pages_wanted(s, own, sharing)
        if want > pool.num_free - reserved:
            if not self.make_room(want - (pool.num_free - reserved), waiting, keep=own):
                return None
            want, shared = self.tables.pages_wanted(s, own, sharing)  # a shared page freed?
            if want > pool.num_free - reserved:
                return None
        start = own.table.length if own is not None else len(shared) * pool.page_size
        return Admission(own, shared, start)

    def admit(self, s: Turn, admission: Admission) -> PagedSequence | BaseException:
        """Give a waiting turn pages for all its known tokens and its cached K/V in them (the
        parked pages it starts from hold it already; shared prefix pages too). Returns the
        table it runs in (the scheduler hands it over: `Turn.run_in`), or the error that
        failed it, its pages freed again."""
        pool, own, shared = self.pool, admission.own, admission.shared
        stale = self.tables.current().pop(key_of(s), None)
        if own is not None:
            assert stale is own
            seq, stale = own.table, None
            self.tables.trim(seq, s.cached)
            self.parked_turns += 1
            self._count("parked_turns", 1)
        else:
            seq = PagedSequence()
            if shared:
                seq.pages = pool.share(shared)
                seq.length = len(shared) * pool.page_size
        ok = pool.reserve(seq, len(s.tokens) - seq.length)
        assert ok, "free pages were counted by plan_admission"
        if stale is not None:  # a new turn of the session: its older pages go
            self.tables.free(stale.table)
        try:
            if s.cached > seq.length:
                assert s.restored is not None
                if s.spilled is not None:  # preempted (paged L1): its K/V comes back
                    pool.scatter(seq.pages, seq.length, s.spilled[:, :, seq.length :])
                elif isinstance(s.restored.kv, StagedPrefix):  # paged L1: L2 -> pages
                    self.loader.start(s, seq, pool)
                else:
                    copy_in(pool, s.restored.kv, seq, seq.length, s.cached)
        except BaseException as exc:
            self.tables.free(seq)
            return exc
        seq.length = s.cached
        if shared:
            self.shared_pages += len(shared)
            self._count("shared_kv_pages", len(shared))
        if s.loading is None:  # else once it is loaded
            self.tables.register(s, seq)
        return seq

    def loaded(self, running: Iterable[Turn]) -> list[tuple[Turn, BaseException | None]]:
        """The running turns whose staged prefix is in their pages now, each with the error
        that kept its copies from being issued (its pages then hold no prefix), or None."""
        return [
            (s, self.loader.finish(s))
            for s in running
            if s.loading is not None and self.loader.done(s)
        ]

    def wait_loading(self, running: Iterable[Turn]) -> None:
        """Nothing to step but turns whose prefix is still being copied in: sleep until the
        first one's copies are done."""
        self.loader.wait_first(running)

    # ---- room ---------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.pool.num_free

    @property
    def quantized(self) -> bool:
        """The pool stores K/V as int8 (a degraded device's, `degraded_kv`)."""
        return self.pool.quantized

    @property
    def device(self) -> torch.device:
        """The device the pool's pages are on."""
        return self.pool.device

    def growth(self, decoding: Iterable[Turn]) -> int:
        """New pages the decoding turns' next token takes (those whose last page is full)."""
        return sum(self.pool.pages_needed(s.paged, 1) for s in decoding if s.paged is not None)

    def make_room(self, pages: int, waiting: Iterable[Turn], keep: Parked | None = None) -> bool:
        """Free parked tables until `pages` more pages are free (`PageTables.unpark`)."""
        return self.tables.unpark(pages, waiting, keep)

    def preempt(self, s: Turn) -> BaseException | None:
        """Move a running turn's K/V out of the pool (into its session's Cache, or with paged
        L1 into host memory beside the pool) and free its pages: it waits to be admitted
        again. The error that failed it instead, or None."""
        failed = self.loader.finish(s) if s.loading is not None else None  # the gather reads it
        if failed is not None:
            return failed
        spilled = None
        try:
            assert s.restored is not None and s.paged is not None
            if self.paged_l1:  # no Cache to take it: it waits beside the pool, in host memory
                spilled = self.pool.to_host(s.paged.pages, 0, s.paged.length)
            else:
                new = self.copy_out(s)
                if new is not None:
                    append_kv(s.restored.kv, new)
        except BaseException as exc:
            return exc
        # an int8 pool's K/V is not in a Cache: those tokens are recomputed
        s.preempt(spilled, kept=not self.pool.quantized or spilled is not None)
        self.preemptions += 1
        self.release(s)
        return None

    # ---- the way out --------------------------------------------------------------------------

    def release(self, s: Turn) -> None:
        """`s` leaves the pool: drop its reference to each page (a shared page stays)."""
        if s.loading is not None:
            self.loader.finish(s)
        if s.paged is not None:
            self.tables.free(s.paged)
            s.lose_pages()

    def leave(self, s: Turn, held: Parked | None) -> None:
        """`s` left the scheduler: if its prefix never reached its pages they go now, so that
        nothing of them is committed; the claimed parked table it never took (`held`) may go
        again."""
        if s.loading is not None and self.loader.finish(s) is not None:
            self.release(s)
        if held is not None:
            self.unclaim(held)

    def park(self, s: Turn) -> bool:
        """Keep a finished turn's pages as its session's (`PageTables.park`); the scheduler
        then lets go of them (`Turn.park`)."""
        return self.tables.park(s)

    def copy_out(self, s: Turn) -> torch.Tensor | None:
        """K/V of tokens [cached, fed) from the pages (nothing from an int8 pool)."""
        assert s.paged is not None
        return copy_out(self.pool, s.paged, s.cached)

    def chunks_out(self, s: Turn) -> CommitPages | None:
        """Paged L1: what a finished turn's commit stores, from the chunk its restored prefix
        ends in to its last fed token. Nothing is gathered here: the commit gathers each chunk
        when it stores it, into a gather buffer of the cache's (`TieredCache.commit_pages`),
        from pages this holds a reference to until the commit hands them back
        (`CommitPages.pages`, freed with `release_held`). None from an int8 pool."""
        if s.paged is None or self.pool.quantized:
            return None
        assert s.restored is not None
        pool, C = self.pool, self.chunk_tokens
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
            if c.pool is not self.pool:
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

    # ---- sessions' parked tables, from other threads ------------------------------------------

    def drop_parked(self, key: Key) -> None:
        """(Any thread, under `cond`) free the session's parked table at the scheduler's next
        iteration, unless a turn on its way in claimed it."""
        self._dropping.append(key)

    def dropping(self) -> bool:
        """(Under `cond`) whether tables wait to be dropped."""
        return bool(self._dropping)

    def drop_asked(self) -> None:
        """(The scheduler's thread, under `cond`) free the tables `drop_parked` asked for."""
        keys, self._dropping = self._dropping, []
        self.tables.drop(keys)

    def dropped(self) -> list[Key]:
        """Paged L1: the sessions whose parked tables went since the last call; they are in
        L2/L3 alone now, which the cache is to hear (off the scheduler's thread)."""
        return self.tables.take_dropped()

    def claim_parked(self, s: Turn) -> Parked | None:
        """(A restore thread) paged L1: the session's parked table, claimed for `s` so that
        nothing frees it before `s` is admitted; None where there is none to claim (none,
        claimed already, of a replaced pool, or to be dropped)."""
        key = key_of(s)
        with self._cond:
            p = self.tables.parked.get(key)
            if p is None or p.claimed or self.tables.stale or key in self._dropping:
                return None
            p.claimed = True
            return p

    def unclaim(self, p: Parked) -> None:
        """(A restore thread, or the scheduler's as its turn leaves) a claimed parked table is
        not taken after all."""
        with self._cond:
            p.claimed = False

    def prepare(self, s: Turn) -> None:
        """(A restore thread) the restored prefix's page keys (a hash per page), computed here
        rather than on the scheduler's thread."""
        if self.tables.share_prefixes and s.cached >= self.pool.page_size:
            self.tables.page_keys(s)

    # ---- the rest -----------------------------------------------------------------------------

    def figures(self) -> tuple[int, int, int, int]:
        """The pool's pages by state for /metrics: parked (a page tables share counts once),
        free, all, and a page's bytes."""
        pool = self.pool
        return self.tables.pages(), pool.num_free, pool.num_pages, pool.page_bytes

    def close(self) -> None:
        """Stop the loader, and free what commits handed back (the scheduler's thread is gone)."""
        self.loader.close()
        self.release_held()


@dataclasses.dataclass(eq=False)
class CommitPages:
    """A finished turn's K/V on its way to the cache: `chunks[j]` gathers tokens
    `[start + j*C, ...)` from `pages` (held for the commit) into the buffer it is given."""

    start: int
    chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]]
    pool: PagePool
    pages: list[int]
    copied: torch.cuda.Event | None = None  # recorded after the last gather (CUDA)
