"""Paged L1: a returning turn's staged prefix, copied from its L2 slots into its new pages.

A loader thread issues the copies, on the cache's copy streams, and nothing waits for them: the
turn runs in no step until they are done (`loading`). Over PCIe a 3,000-token prefix of a 7B
model takes a few ms, which a step waiting on the GPU would add to every sequence's token, and
issuing its dozen copies on the scheduler thread would delay the next step's launch.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier.cache.restore import StagedPrefix
from kvtier.paged import PagedSequence, PagePool
from kvtier.server.backend import PagedBackend
from kvtier.server.pages.parking import PageTables

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.turn import Turn
    from kvtier.transfer.staging import Handle


class StagedLoader:
    """Issues staged prefixes' copies into pages on one thread (`executor`); `backend` is the
    cache behind the pool (paged L1; with none nothing is staged) and `tables` makes a loaded
    prefix's pages shareable."""

    def __init__(self, backend: PagedBackend | None, tables: PageTables) -> None:
        self._backend = backend
        self._tables = tables
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "kvtier-load")

    def start(self, s: Turn, seq: PagedSequence, pool: PagePool) -> None:
        """Copy `s`'s staged prefix into `seq`'s pages past those it shares (`s.loading`)."""
        assert s.restored is not None
        staged, s.restored.kv = s.restored.kv, None
        # the table as it is now: the admission sets its length to the prefix's end next
        pages, start = list(seq.pages), seq.length
        s.loading = self.executor.submit(self._issue, s, staged, pool, pages, start)

    def _issue(
        self, s: Turn, staged: StagedPrefix, pool: PagePool, pages: list[int], start: int
    ) -> Handle:
        """On the loader thread: issue a staged prefix's copies into `pages` from token
        `start` on, then unpin it (a slot is reused only once its copies are done). Returns
        their Handle."""
        job, backend = s.job, self._backend
        assert backend is not None, "a staged prefix comes from a paged L1 backend"
        # the cache's session its restore returned: no lookup by id
        session = s.restored.session if s.restored is not None else None
        # the copies land straight in the pool: `write(first, chunks)` is its `write_chunks`
        write = functools.partial(pool.write_chunks, pages, start=start)
        try:
            return backend.load_staged(job.session_id, job.tenant, staged, write, session=session)
        finally:
            backend.release_staged(job.session_id, job.tenant, staged, session=session)

    @staticmethod
    def done(s: Turn) -> bool:
        """Whether a loading turn's copies are done (or failed to be issued)."""
        fut = s.loading
        assert fut is not None
        if not fut.done():
            return False
        return fut.exception() is not None or fut.result().done()

    def finish(self, s: Turn) -> BaseException | None:
        """A turn's staged prefix is in its pages, or must be taken as if it were (the turn
        leaves): waits for the copies to be issued, orders the compute stream after them (free
        once they are done) before anything reads or frees the pages, and lets them be shared.
        Returns the error when they could not be issued: the pages hold no prefix."""
        fut, s.loading = s.loading, None
        assert fut is not None
        try:
            handle = fut.result()
        except BaseException as exc:
            return exc
        handle.wait_stream()
        if s.paged is not None and not s.gone:
            self._tables.register(s, s.paged)
        return None

    @staticmethod
    def wait_first(running: Iterable[Turn]) -> None:
        """Nothing to step but turns whose prefix is still being copied in: sleep until the
        first one's copies are done (rather than spin through empty iterations)."""
        for s in running:
            if s.loading is not None:
                try:
                    s.loading.result().wait()
                except BaseException:  # the next iteration fails the turn
                    pass
                return

    def close(self) -> None:
        self.executor.shutdown(wait=True)
