"""The batch's scheduling policy: what runs this step, which turns are admitted, which is
preempted (kvtier/server/batch/batching.py's module docstring, steps 2 to 4).

`TurnScheduler` owns the turns' queues (`RunQueues`) and decides; the page manager
(`kvtier.server.pages.Pages`) carries its decisions out on the pages. `schedule` returns a
`Schedule`: the step's items, and the turns the batch is to fail or cut short first. It calls
nothing back: the batch scheduler acts on what it returns. It runs on the scheduler thread,
holds no model and does no I/O.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.server.batch.promptorder import PromptOrder

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.turn import Turn
    from kvtier.server.pages import Admission, Pages

Item = tuple["Turn", Sequence[int]]  # a turn and its tokens to feed this step


class RunQueues:
    """The turns the scheduler holds, by where they are: `arrived` (restored, handed over by a
    restore thread), `waiting` (for pages and a slot) and `running` (in pages). `cond` is the
    scheduler's condition: restore threads change `arrived` and `restoring` under it."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.arrived: list[Turn] = []
        self.waiting: deque[Turn] = deque()
        self.running: list[Turn] = []
        self.restoring = 0  # submitted turns whose restore has not finished
        self.closed = False  # no more submissions: the scheduler stops once all are done

    def submitted(self) -> None:
        """A turn goes to be restored (refused once the scheduler is closed)."""
        with self.cond:
            if self.closed:
                raise KvtierError("the batch scheduler is closed; the server is shutting down")
            self.restoring += 1

    def arrive(self, s: Turn) -> None:
        """(A restore thread) a restored turn waits for the scheduler thread."""
        with self.cond:
            self.restoring -= 1
            self.arrived.append(s)
            self.cond.notify_all()

    def not_restored(self) -> None:
        """(A restore thread) a turn's restore failed: it never arrives."""
        with self.cond:
            self.restoring -= 1
            self.cond.notify_all()

    def take_arrived(self) -> None:
        """(Under `cond`) the arrived turns wait for admission, in their order."""
        self.waiting.extend(self.arrived)
        self.arrived.clear()

    def leave(self, s: Turn) -> None:
        """`s` leaves the scheduler, from wherever it was."""
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def all(self) -> list[Turn]:
        return [*self.running, *self.waiting]


@dataclasses.dataclass
class Schedule:
    """What `TurnScheduler.schedule` decided. `items` run in the step. Before it the batch
    scheduler fails the `failed` turns (they left the queues) and ends `cut` (alone in a full
    pool: its reply ends here). With `again` it asks for a new schedule after doing so (their
    pages are free then), and with `drain` after taking the step in flight's tokens (its
    finished turns may free pages, and a turn preempted must hold its real tokens)."""

    items: list[Item] = dataclasses.field(default_factory=list)
    failed: list[tuple[Turn, BaseException]] = dataclasses.field(default_factory=list)
    cut: Turn | None = None
    again: bool = False
    drain: bool = False


class TurnScheduler:
    def __init__(
        self,
        *,
        cond: threading.Condition,
        pages: Pages,
        prompts: PromptOrder,
        max_batch: int,
        batch_tokens: int,
        prefill_step: int,
        decoding_prompt_tokens: int,
        admissions_per_step: int,
    ) -> None:
        self.queues = RunQueues(cond)
        self.pages = pages
        self.prompts = prompts
        self.max_batch = max_batch
        self.batch_tokens = batch_tokens
        self.prefill_step = prefill_step
        self.decoding_prompt_tokens = decoding_prompt_tokens
        self.admissions_per_step = admissions_per_step

    def schedule(self, step_in_flight: bool) -> Schedule:
        """The step's items: (turn, its tokens to feed), after the admissions and preemptions
        that make room for them; `step_in_flight`: a step's tokens are not taken yet."""
        q, pages = self.queues, self.pages
        pages.release_held()  # pages finished commits are done with
        out = Schedule()
        for s, failed in pages.loaded(q.running):  # their prefix is in their pages
            if failed is not None:
                q.running.remove(s)
                out.failed.append((s, failed))
        if out.failed:
            out.again = True  # their pages are free once they failed
            return out
        # Decoding turns first, one token each; free pages for the ones whose page is full.
        need = 0
        while q.running:
            need = pages.growth(self.decoding())
            if need <= pages.free or pages.make_room(need - pages.free, q.waiting):
                break
            if step_in_flight:
                out.drain = True
                return out
            if pages.await_held():  # room that commits are about to hand back
                continue
            victim = q.running[-1]
            if len(q.running) == 1:
                out.cut, out.again = victim, True
                return out
            q.running.remove(victim)
            failed = pages.preempt(victim)
            if failed is not None:
                out.failed.append((victim, failed))
                out.again = True
                return out
            q.waiting.appendleft(victim)
            need = 0
        out.items = [(s, s.tokens[-1:]) for s in self.decoding()]
        decoding = bool(out.items)
        budget = self.batch_tokens - len(out.items)
        if out.items and self.decoding_prompt_tokens:
            # Turns decode in this step: a few prompt tokens ride along, so each of their
            # tokens waits one short step (docs/architecture.md, "The batching scheduler",
            # has the measurements behind `decoding_prompt_tokens`).
            budget = min(budget, self.decoding_prompt_tokens)
        prefilling = [s for s in q.running if s.loading is None and s.unfed > 1]
        # A long prompt (a new conversation) does not hold back admissions: room is what the
        # budget leaves after the prompts that finish in one chunk, which go first anyway.
        room = budget - sum(
            min(s.unfed, self.prefill_step) for s in prefilling if s.unfed <= budget
        )
        admitted = 0
        # the cap protects decoding turns from a long step; with none, admit freely
        cap = self.admissions_per_step if decoding else 0
        while q.waiting and room > 0 and len(q.running) < self.max_batch:
            if cap and admitted >= cap:
                break
            s = q.waiting[0]
            try:
                plan = pages.plan_admission(s, need, bool(q.running), q.waiting)
            except KvtierError as exc:  # it never fits as it is
                q.waiting.popleft()
                out.failed.append((s, exc))
                continue
            if plan is None:  # the pool is full: it waits for a turn to finish
                if not q.running and pages.await_held():
                    continue  # commits handed pages back: try again
                break
            q.waiting.popleft()
            failed = self.admit(s, plan)
            if failed is not None:
                out.failed.append((s, failed))
                continue
            q.running.append(s)
            admitted += 1
            if s.loading is not None:  # its first chunk waits for its prefix's copies
                continue
            prefilling.append(s)
            room -= min(s.unfed, self.prefill_step)
        out.items += self.prompts.chunks(prefilling, budget)
        return out

    def admit(self, s: Turn, plan: Admission) -> BaseException | None:
        """Admit the waiting turn `s` as `plan` says (`Pages.admit`): it runs in the table the
        page manager gives it. The error that failed it instead, or None."""
        s.trace.admitting(self.pages.device)  # its queue time ends here
        table = self.pages.admit(s, plan)
        if isinstance(table, BaseException):
            return table
        if s.cached > plan.start:
            s.trace.copied_in()
        s.run_in(table)
        if self.pages.quantized:  # its steps read int8 pages: the response and metrics say so
            s.stream.degraded_kv = "int8"
        return None

    def decoding(self) -> list[Turn]:
        return [s for s in self.queues.running if s.unfed == 1 and s.loading is None]

    def evacuate(self, keep: bool) -> list[tuple[Turn, BaseException]]:
        """Every running turn leaves the pool and waits at the head of the queue, in its order.
        With `keep` its K/V first moves out (`Pages.preempt`); without, its pages are dropped
        unread (they go with the pool) and the tokens they held are recomputed when it is
        admitted again. Returns the turns whose K/V could not be moved, with the error: they
        are to fail."""
        q, failed = self.queues, []
        for s in reversed(list(q.running)):
            q.running.remove(s)
            if keep:
                fault = self.pages.preempt(s)
                if fault is not None:
                    failed.append((s, fault))
                    continue
            else:
                s.lose_pages()  # they go with the old pool; `cached` is what its Cache holds
            q.waiting.appendleft(s)
        return failed
