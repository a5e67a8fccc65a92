"""A submitted turn's restore, on a small pool of restore threads, before it joins the batch.

The tiered cache hands back the turn's cached prefix: a transformers Cache over its first
`covered` prompt tokens in L1, or (paged L1) a staged prefix waiting in L2, or the session's
own parked pages. A restore into L1 holds the session there until the turn is committed or
aborted; when L1 is full of such sessions, a restore waits for one to be released.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.cache.restore import StagedPrefix, common_prefix
from kvtier.errors import L1BudgetExceeded
from kvtier.server.backend import Backend, PagedBackend, Restored
from kvtier.server.batch.jobs import Job, Started
from kvtier.server.batch.turntrace import TurnTrace

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.scheduler import RunQueues
    from kvtier.server.batch.turn import Turn
    from kvtier.server.config import ServerConfig
    from kvtier.server.pages import Pages

# Restore threads, and as many commit threads, on a CUDA device. A restore from L2 spends most
# of its time waiting (for locks, the GIL, its copies), so more threads admit more returning
# turns: in the 256-session fleet on an H200, 4 threads served 2,266 tok/s and 8 served
# 2,577-2,679 (docs/benchmarks-history.md, "The restore threads' waits").
HELPER_THREADS_CUDA = 8


def helper_threads(config: ServerConfig, device: Any) -> int:
    """Restore (and commit) threads: `helper_threads` when set (a bench sweeps it), else 8 on a
    CUDA device and 2 on the CPU, where they compete with the scheduler for the cores."""
    default = HELPER_THREADS_CUDA if device.type == "cuda" else 2
    return config.helper_threads or default


def in_l1(restored: Restored) -> bool:
    """Whether a restore holds its session in the cache's L1 until released: not a staged
    prefix (paged L1: it waits in L2), nor nothing at all."""
    return restored.kv is not None and not isinstance(restored.kv, StagedPrefix)


class RestoreWorkers:
    """Restores turns on `threads` threads (`executor`) and counts the L1 they hold.

    A restored turn arrives in the scheduler's `queues`; a failed one is reported (`report`,
    the commit threads' `TurnCommits.report`) and never arrives. The queues' condition guards
    `holding` and `released` too."""

    def __init__(
        self,
        backend: Backend,
        paged: PagedBackend | None,
        pages: Pages,
        queues: RunQueues,
        threads: int,
        queue_timeout: float,
        report: Callable[[Turn, BaseException], None],
    ) -> None:
        self.backend = backend
        self.paged = paged
        self.pages = pages
        self.queues = queues
        self._cond = queues.cond
        self.queue_timeout = queue_timeout
        self._report = report
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, "kvtier-restore")
        # L1 room: turns restored and not yet committed or aborted hold their session in L1;
        # each commit or abort makes one evictable again (`release_l1`)
        self.holding = 0
        self.released = 0

    def submit(self, s: Turn) -> None:
        self.executor.submit(self.restore, s)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    def restore(self, s: Turn) -> None:
        job = s.job
        s.trace.restore = time.perf_counter()
        try:
            restored, holds = self._resume_held(s), False
            if restored is None:
                restored = self._when_room(job, s.trace)
                holds = in_l1(restored)
        except BaseException as exc:  # nothing restored, nothing to abort
            self._report(s, exc)
            self.queues.not_restored()
            return
        s.begin(restored, holds)
        self.pages.prepare(s)
        s.trace.restored = time.perf_counter()
        s.stream.put(Started(restored.source, s.cached, len(job.prompt_ids)))
        self.queues.arrive(s)

    def _when_room(self, job: Job, trace: TurnTrace) -> Restored:
        """`backend.restore`, waiting while L1 is full of sessions whose turns are running: each
        commit makes one evictable again (the wait is added to `trace.room_wait_s`). Fails when
        nothing holds L1 (the session alone does not fit) or after `queue_timeout`, as a wait
        for a slot would."""
        deadline = time.monotonic() + self.queue_timeout
        while True:
            with self._cond:
                seen = self.released
            try:
                # the prompt as a list: made on the device, its copy would queue behind the
                # steps in flight on the default stream, and the cache reads it back as a list
                if self.paged is not None:  # the prefix stays in L2 until the pages take it
                    restored = self.paged.restore_staged(job.session_id, job.tenant, job.prompt_ids)
                else:
                    restored = self.backend.restore(job.session_id, job.tenant, job.prompt_ids)
            except L1BudgetExceeded:
                with self._cond:
                    if self.holding == 0 or self.queues.closed:
                        raise
                    t0 = time.perf_counter()
                    moved = self._cond.wait_for(
                        lambda seen=seen: self.released != seen or self.queues.closed,  # type: ignore[misc]
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                    trace.room_wait_s += time.perf_counter() - t0
                if not moved or self.queues.closed:
                    raise
                continue
            if in_l1(restored):
                with self._cond:
                    self.holding += 1
            return restored

    def _resume_held(self, s: Turn) -> Restored | None:
        """Paged L1: start from the session's parked pages, claimed so that nothing frees
        them before the turn is admitted, when the cache vouches for their tokens."""
        if self.paged is None:
            return None
        job = s.job
        p = self.pages.claim_parked(s)
        if p is None:
            return None
        held = common_prefix(p.tokens, job.prompt_ids)
        try:
            restored = self.paged.resume_pages(job.session_id, job.tenant, job.prompt_ids, held)
        except Exception:  # the restore below meets the same error and reports it
            restored = None
        if restored is None:
            self.pages.unclaim(p)
            return None
        s.claim(p)
        return restored

    def release_l1(self, s: Turn) -> None:
        """A restored turn was committed or aborted, or (paged L1) its prefix went from L1 into
        its pages: its session's L1 may be evicted, or is free, again."""
        with self._cond:
            if s.let_go_of_l1():
                self.holding -= 1
            self.released += 1
            self._cond.notify_all()
