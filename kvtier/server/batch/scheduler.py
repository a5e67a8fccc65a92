"""The batch's scheduling policy: what runs this step, which turns are admitted, which is
preempted (kvtier/server/batch/batching.py's module docstring, steps 2 to 4).

`TurnScheduler` decides; the parts carry its decisions out: the page manager (`TurnPages`)
admits a turn into pages or preempts one out of them, `PageTables` frees parked pages, the
staged loader reports a turn's prefix copied in. It runs on the scheduler thread, holds no
model and does no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.server.batch.jobs import pool_too_small
from kvtier.server.batch.promptorder import PromptOrder

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.paged import PagePool
    from kvtier.server.batch.stepping import StepRunner
    from kvtier.server.batch.turn import Turn
    from kvtier.server.pages.kvpages import TurnPages
    from kvtier.server.pages.loading import StagedLoader
    from kvtier.server.pages.parking import PageTables, Parked


class TurnScheduler:
    def __init__(
        self,
        *,
        pool: Callable[[], PagePool],
        running: list[Turn],
        waiting: deque[Turn],
        pages: TurnPages,
        tables: PageTables,
        loader: StagedLoader,
        steps: StepRunner,
        drain: Callable[[], None],
        prompts: PromptOrder,
        fail: Callable[[Turn, BaseException], None],
        out_of_room: Callable[[Turn], None],
        max_batch: int,
        batch_tokens: int,
        prefill_step: int,
        decoding_prompt_tokens: int,
        admissions_per_step: int,
    ) -> None:
        self.pool = pool  # the scheduler's pool (a device failover replaces it)
        self.running = running
        self.waiting = waiting
        self.pages = pages
        self.tables = tables
        self.loader = loader
        self._steps = steps  # only to see whether a step is in flight
        self._drain = drain  # take its tokens, and end the turns it ended
        self.prompts = prompts
        self._fail = fail
        self._out_of_room = out_of_room
        self.max_batch = max_batch
        self.batch_tokens = batch_tokens
        self.prefill_step = prefill_step
        self.decoding_prompt_tokens = decoding_prompt_tokens
        self.admissions_per_step = admissions_per_step

    def schedule(self) -> list[tuple[Turn, Sequence[int]]]:
        """The step's items: (turn, its tokens to feed), and the admissions and preemptions
        that make room for them."""
        pool = self.pool()
        self.pages.release_held()  # pages finished commits are done with
        for s in [s for s in self.running if s.loading is not None and self.loader.done(s)]:
            failed = self.loader.finish(s)  # its prefix is in its pages
            if failed is not None:
                self._fail(s, failed)
        # Decoding sequences first, one token each; free pages for the ones whose page is full.
        need = 0
        while self.running:
            need = sum(pool.pages_needed(s.paged, 1) for s in self.decoding() if s.paged)
            if need <= pool.num_free or self.unpark(need - pool.num_free):
                break
            if self._steps.pending is not None:
                # its finished turns may free pages; and a preempted sequence must hold its
                # real tokens, not placeholders
                self._drain()
                continue
            if self.pages.await_held():  # room that commits are about to hand back
                continue
            victim = self.running[-1]
            if len(self.running) == 1:
                self._out_of_room(victim)
            else:
                self.pages.preempt(victim)
            need = 0
        items: list[tuple[Turn, Sequence[int]]] = [(s, s.tokens[-1:]) for s in self.decoding()]
        decoding = bool(items)
        budget = self.batch_tokens - len(items)
        if items and self.decoding_prompt_tokens:
            # Sessions decode in this step: a few prompt tokens ride along, so each of their
            # tokens waits one short step. On an H200 (7B, 64 decoding over 3,000-token
            # contexts) a step took 14 ms alone, 26 ms with 196 prompt tokens and 125 ms with
            # 930, i.e. prompt tokens cost half as much in small pieces. 192 rather than 128:
            # turns then wait less for their prompt's turn and the batch runs fuller (the
            # fleet bench on an H200: 3,140 tok/s against 2,924 with 64 sessions).
            budget = min(budget, self.decoding_prompt_tokens)
        prefilling = [s for s in self.running if s.loading is None and s.unfed > 1]
        # A long prompt (a new conversation) does not hold back admissions: room is what the
        # budget leaves after the prompts that finish in one chunk, which go first anyway.
        room = budget - sum(
            min(s.unfed, self.prefill_step) for s in prefilling if s.unfed <= budget
        )
        admitted = 0
        # the cap protects decoding sequences from a long step; with none, admit freely
        cap = self.admissions_per_step if decoding else 0
        while self.waiting and room > 0 and len(self.running) < self.max_batch:
            if cap and admitted >= cap:
                break
            s = self.waiting[0]
            pages = pool.pages_for(len(s.tokens))
            if pages > pool.num_pages:
                self.waiting.popleft()
                self._fail(s, pool_too_small(len(s.tokens), pool.num_pages * pool.page_size))
                continue
            own = self.tables.own_pages(s)
            if s.held is not None and own is None:  # a device failover rebuilt the pool
                self.waiting.popleft()
                self._fail(s, KvtierError("the session's K/V pages were lost; send it again"))
                continue
            want, shared = self.tables.pages_wanted(s, own, bool(self.running))  # shared: held
            if want > pool.num_free - need:  # the decoders' new pages come first
                if not self.unpark(want - (pool.num_free - need), keep=own):
                    if not self.running and self.pages.await_held():
                        continue  # commits handed pages back: try again
                    break  # the pool is full: it waits for a sequence to finish
                want, shared = self.tables.pages_wanted(s, own, bool(self.running))  # freed?
                if want > pool.num_free - need:
                    break
            self.waiting.popleft()
            if not self.pages.admit(s, shared, own):
                continue
            admitted += 1
            if s.loading is not None:  # its first chunk waits for its prefix's copies
                continue
            prefilling.append(s)
            room -= min(s.unfed, self.prefill_step)
        items += self.prompts.chunks(prefilling, budget)
        return items

    def decoding(self) -> list[Turn]:
        return [s for s in self.running if s.unfed == 1 and s.loading is None]

    def unpark(self, pages: int, keep: Parked | None = None) -> bool:
        """Free parked tables until `pages` more pages are free (`PageTables.unpark`)."""
        return self.tables.unpark(pages, self.waiting, keep)
