"""ChunkWriter: a session's chunks on their way down, L1 (or a batch's pages) -> L2 -> L3.

Every full chunk gets its key when it completes, and the write policy decides whether it is
stored now (write-through), once it was seen often enough (write-through-selective), or only
when the session leaves L1 (write-back: hibernate, eviction). A stored chunk has an L2 slot
(one copy down from the device) and is then handed to each cold tier in order
(`ColdTier.write`): L3 queues its write behind it. The session's partial tail
is stored only when it leaves L1, so the session resumes whole.

Backpressure: a chunk that must be stored (L1 will not hold it after this) and finds every L2
slot busy with an L3 write waits for one to finish; where nothing is left to wait for, the
session's stored prefix ends there (counted as a drop, recomputed at its next turn). The
caller holds the guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.keys import ZERO_KEY

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.catalog import ChunkCatalog
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.session import Session
    from kvtier.cache.stats import Counters
    from kvtier.transfer import TransferEngine

log = logging.getLogger("kvtier.cache")

ChunkSource = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
"""A chunk of K/V from a batch's pages for `commit_pages`: the tensor, or a function that
gathers it into the device buffer it is given (`out`, in the chunk layout) and returns it,
called when the chunk is stored, under the bound of copies in flight."""


class ChunkWriter:
    def __init__(
        self,
        identity: CacheIdentity,
        directory: ChunkDirectory,
        engine: TransferEngine,
        counters: Counters,
        catalog: ChunkCatalog,
    ) -> None:
        self.identity = identity
        self.config = identity.config
        self.directory = directory
        self.engine = engine
        self.counters = counters
        self.catalog = catalog

    def write_completed(
        self,
        s: Session,
        *,
        evicting: bool = False,
        pages: Sequence[ChunkSource] | None = None,
        start: int = 0,
    ) -> None:
        """Key every newly completed full chunk and apply the write policy to it.

        When evicting, a chunk that finds no L2 slot (every slot in flight) waits for L3
        writes to free one (backpressure); where waiting cannot (nothing in flight to wait
        for) it ends the session's stored prefix there, counted as a drop: the session keeps
        only what is stored somewhere. `pages`: the K/V of the chunks from token `start` on
        from a batch's pages (`commit_pages`; `pages[j]` the chunk at `start + j*C`, a tensor or
        a function gathering it), where L1 holds none: every new chunk is then stored, as when
        evicting, from `s.flushed` on."""
        C = self.identity.chunk_tokens
        n_full = len(s.tokens) // C
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        for i in range(len(s.chunk_keys), n_full):
            parent = self.catalog.key_for(parent, s.tokens[i * C : (i + 1) * C], s)
            s.chunk_keys.append(parent)
        d = self.directory
        policy = self.config.write_policy
        # Evicting, every chunk is checked again: L3 may have dropped one (size cap) after L2
        # let its copy go, and L1 holds the last copy now.
        must = evicting or pages is not None  # L1 will not hold the chunk after this
        for i in range(0 if evicting else s.flushed, n_full):
            e = d.ensure(s.chunk_keys[i], s.chunk_keys[i - 1] if i else ZERO_KEY, C)
            e.seen += i >= s.flushed
            if d.stored(e):
                continue  # already stored once (prefix shared with another session)
            if not (
                must
                or policy == "write_through"
                or (
                    policy == "write_through_selective" and e.seen >= self.config.selective_min_hits
                )
            ):
                continue
            chunk = None if pages is None else pages[i - start // C]
            if not self.write_down(s, i * C, e, tenant=s.tenant, chunk=chunk, wait=must) and must:
                log.warning(
                    "L2 has no free slot for chunk %s leaving L1; session %r keeps %d tokens",
                    e.key.hex(),
                    s.session_id[:64],
                    i * C,
                )
                self.counters.count_drop()
                s.cut(i * C)
                return
            del chunk  # a gathered chunk is the engine's (in flight) from here
        # Only chunks that were written (or already stored) count as flushed.
        while s.flushed < n_full:
            e2 = d.get(s.chunk_keys[s.flushed])
            if e2 is None or not d.stored(e2):
                break
            s.flushed += 1

    def write_down(
        self,
        s: Session,
        pos: int,
        e: Chunk,
        *,
        tenant: str,
        chunk: ChunkSource | None = None,
        wait: bool = False,
    ) -> bool:
        """L1 -> L2 now (one D2H copy), then each cold tier takes it (`ColdTier.write`: L3
        queues its write, shed if the queue is full). `chunk`: the chunk's K/V already in the chunk layout on the device (a batch's pages,
        `commit_pages`), or a function that gathers it, instead of the session's L1. `wait`:
        when every L2 slot is in flight, wait for L3 writes to free one (`_l2_slot`). False if
        L2 has no slot that is not in flight (the chunk is not stored)."""
        slot = self._l2_slot(wait)
        if slot is None:
            return False
        if chunk is not None:
            self._offload_chunk(chunk, slot, e.tokens)
        else:
            assert s.bufs is not None
            # the last copy from the session's L1: its release waits for it or counts it
            s.bufs.copy = self.engine.offload(
                s.bufs.layers, pos, e.tokens, slot, block=s.bufs.block
            )
        e.l2_slot = slot
        e.tenant = tenant
        for tier in self.catalog.tiers:  # L2 keeps it, L3 queues its write, ...
            tier.write(e)
        self.counters.stored["chunks"] += 1
        self.counters.stored["tokens"] += e.tokens
        return True

    def _l2_slot(self, wait: bool) -> int | None:
        """A free L2 slot (`ChunkDirectory.alloc`). With `wait`, while every slot is in flight
        (L3 writes of chunks L2 alone holds, reads), wait for one of those to finish and try
        again (backpressure: counted, seconds too); None once nothing is left to wait for."""
        d = self.directory
        slot = d.alloc()
        while slot is None and wait:
            waited = d.wait_for_room()
            if waited is None:
                break
            self.counters.count_wait(waited)
            slot = d.alloc()
        return slot

    def _offload_chunk(self, chunk: ChunkSource, slot: int, tokens: int) -> None:
        """Copy a chunk of `tokens` tokens from pages into `slot`. A function gathers it into
        one of the engine's gather buffers (`TransferEngine.gather_buffer`: a burst of commits
        waits there for room under the bound of copies in flight)."""
        if not callable(chunk):
            self.engine.offload_chunk(chunk, slot)
            return
        ticket, buf = self.engine.gather_buffer(tokens)
        try:
            data = chunk(buf)
        except BaseException:
            self.engine.give_back(ticket)
            raise
        self.engine.offload_chunk(data, slot, ticket=ticket)

    def write_tail(
        self, s: Session, pages: Sequence[ChunkSource] | None = None, start: int = 0
    ) -> None:
        """Store the session's partial tail (it leaves L1): its own key, its own namespace.
        `pages`, `start`: as for `write_completed`."""
        C = self.identity.chunk_tokens
        t = len(s.tokens) % C
        if t == 0:
            s.tail_key = None
            return
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        key = self.catalog.tail_key(parent, s.tokens[-t:], s)
        e = self.directory.ensure(key, parent, t)
        pos = len(s.tokens) - t
        chunk = None if pages is None else pages[pos // C - start // C]  # chunk number pos // C
        if not self.directory.stored(e):
            if not self.write_down(s, pos, e, tenant=s.tenant, chunk=chunk, wait=True):
                self.counters.count_drop()
                s.cut(len(s.tokens) - t)  # the tail is recomputed on resume
                return
            self.counters.stored["tails"] += 1
            self.counters.stored["tail_tokens"] += t
        s.tail_key = key

    def queue_session_writes(self, s: Session) -> list[tuple[Chunk, Future[Any]]]:
        """Queue L3 writes of the session's chunks that only L2 holds; returns the writes in
        flight on its chunks."""
        d = self.directory
        d.reap_writes()
        writes = []
        for key in [*s.chunk_keys] + ([s.tail_key] if s.tail_key else []):
            e = d.get(key)
            if e is None:
                continue
            if not d.in_l3(key) and e.l3_write is None and e.l2_slot is not None:
                d.queue_write(e)
            if e.l3_write is not None:
                writes.append((e, e.l3_write))
        return writes
