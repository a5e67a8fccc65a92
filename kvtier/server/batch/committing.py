"""The end of a batched turn off the scheduler thread: its commit, or its abort, and the events
that close its stream.

A finished turn's new K/V goes to the cache here, on a small pool of commit threads, so that
restores and commits never stall the batch: with paged L1 its chunks are gathered one at a time
from the pages it holds into the cache's gather buffers and stored (`commit_pages`), and the
pages go back to the scheduler after; else the K/V copied out of the pages is appended to the
session's Cache and committed, exactly as the per-request worker does. Either way: hibernate on
cancel, forget when ephemeral. A commit that fails never fails its reply, which was generated
already: the session keeps what was stored, and the failure is counted by reason.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import KvtierError, L4Unavailable, StoreError, StoreFullError
from kvtier.server.backend import Backend, PagedBackend
from kvtier.server.batch.counters import Counters
from kvtier.server.batch.jobs import Failed, Finished
from kvtier.server.pages import CommitPages, append_kv

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.session import Session
    from kvtier.server.batch.turn import Turn

log = logging.getLogger("kvtier.server")


def failure_reason(exc: BaseException) -> str:
    """The `reason` label of a failed commit (`kvtier_commit_failures_total`)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "device_oom"
    if isinstance(exc, StoreFullError):
        return "l3_full"
    if isinstance(exc, L4Unavailable):
        return "l4"
    if isinstance(exc, (StoreError, OSError)):
        return "l3_io"
    return "internal"


def restored_session(s: Turn) -> Session | None:
    """The cache's session the turn's restore returned (`Restored.session`): its commit or
    abort acts on it rather than find it again by id. None before the restore or without a
    cache."""
    return s.restored.session if s.restored is not None else None


class TurnCommits:
    """Commits and aborts of finished turns on `threads` commit threads (`executor`).

    `release_l1(s)` is told when a restored turn's session may leave L1 again (the restore
    workers' `release_l1`), `counters` take the tokens and the failed commits for /metrics,
    `on_error(exc)` hears of every error that fails a request or a commit (the engine's: a lost
    device stops the server), and `hand_back(pages)` takes the pages a commit held back to the
    scheduler's thread (the page manager's `hand_back`)."""

    def __init__(
        self,
        backend: Backend,
        paged: PagedBackend | None,
        chunk_tokens: int,
        threads: int,
        counters: Counters,
        release_l1: Callable[[Turn], None],
        hand_back: Callable[[CommitPages], None],
        on_error: Callable[[BaseException], Any] | None = None,
    ) -> None:
        self.backend = backend
        self.paged = paged
        self.chunk_tokens = chunk_tokens
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, "kvtier-commit")
        self.counters = counters
        self._release_l1 = release_l1
        self._hand_back = hand_back
        self._on_error = on_error

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        return self.executor.submit(fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    def quiesce(self) -> None:
        """Wait for every commit in flight; later ones go to fresh threads."""
        old, self.executor = (
            self.executor,
            concurrent.futures.ThreadPoolExecutor(2, "kvtier-commit"),
        )
        old.shutdown(wait=True)

    # A commit stores the turn's K/V (its first `fed` tokens), then closes its stream. The
    # reply is delivered whatever the commit meets (a device OOM, full tiers, an I/O error, L4
    # down): the turn's K/V past what was stored is dropped, to be recomputed at the session's
    # next turn, and the failure is counted by reason (`_commit_failed`).

    def commit_pages(self, s: Turn, reason: str, fed: int, pages: CommitPages | None) -> None:
        """Paged L1: store the turn's new chunks from the pages it holds (`Pages.chunks_out`;
        None from an int8 pool, where the stored prefix stays), then close its stream."""
        assert self.paged is not None
        try:
            if pages is None:
                self.backend.abort(s.job.session_id, s.job.tenant, session=restored_session(s))
            else:
                self._store_chunks(s, fed, pages)
            self._session_after(s, reason)
        except BaseException as exc:
            self._commit_failed(s, exc)
        self._close(s, reason)

    def commit_cache(self, s: Turn, reason: str, fed: int, new: torch.Tensor | None) -> None:
        """Append the K/V copied out of the turn's pages (`Pages.copy_out`; None from an int8
        pool) to its session's Cache and commit what the Cache covers, as the per-request
        worker does; then close its stream."""
        job = s.job
        assert s.restored is not None
        try:
            if new is not None:
                append_kv(s.restored.kv, new)
            # what the KV covers, also after a disconnect: a returning client finds it
            self.backend.commit(
                job.session_id, job.tenant, s.tokens[:fed], session=restored_session(s)
            )
            self._session_after(s, reason)
        except BaseException as exc:
            self._commit_failed(s, exc)
        self._close(s, reason)

    def _session_after(self, s: Turn, reason: str) -> None:
        """An ephemeral session is forgotten; one whose client went away leaves L1."""
        job = s.job
        if job.ephemeral:
            self.backend.forget(job.session_id, job.tenant)
        elif reason == "cancelled":
            self.backend.hibernate(job.session_id, job.tenant)

    def _close(self, s: Turn, reason: str) -> None:
        """The turn's tokens counted, its session free to leave L1, its stream's Finished."""
        job = s.job
        assert s.restored is not None
        total = len(job.prompt_ids)
        if not job.internal:
            self.counters.count("completion_tokens", len(s.reply.ids))
            self.counters.count("prompt_tokens", total)
        self._release_l1(s)
        s.stream.put(
            Finished(reason, total, len(s.reply.ids), s.restored.covered, s.restored.source)
        )
        s.done.set_result(None)

    def _store_chunks(self, s: Turn, fed: int, new: CommitPages) -> None:
        """Store the turn's chunks from its held pages, then hand the pages back."""
        job = s.job
        assert self.paged is not None
        try:
            chunks = new.chunks
            upto = fed
            if job.ephemeral:  # forgotten next: its full chunks alone
                upto = max(new.start, fed // self.chunk_tokens * self.chunk_tokens)
                chunks = chunks[: (upto - new.start) // self.chunk_tokens]
            self.paged.commit_pages(
                job.session_id,
                job.tenant,
                s.tokens[:upto],
                new.start,
                chunks,
                session=restored_session(s),
            )
        finally:
            if new.pool.device.type == "cuda":
                try:
                    new.copied = torch.cuda.Event()
                    new.copied.record(torch.cuda.current_stream(new.pool.device))
                except Exception:  # a lost device: its pool goes with it
                    new.copied = None
            self._hand_back(new)

    def _commit_failed(self, s: Turn, exc: BaseException) -> None:
        """A commit failed after its reply was generated: the session keeps what was stored
        before (the rest is recomputed at its next turn); counted and logged, never the
        reply's failure."""
        job = s.job
        reason = failure_reason(exc)
        self.counters.commit_failure(reason)
        log.warning(
            "session %s: the commit failed (%s: %r); the reply is delivered, its K/V past the "
            "stored prefix is recomputed at the next turn",
            job.session_id[:64],
            reason,
            exc,
        )
        self.error(exc)  # a lost device still stops the server
        self._abort_session(s, "abort after a failed commit failed for session %s")

    def _abort_session(self, s: Turn, failed: str) -> None:
        """Forget the turn's half-written step in its session (and an ephemeral session
        altogether); a failure to do so is logged with `failed` and goes no further."""
        job = s.job
        try:
            self.backend.abort(job.session_id, job.tenant, session=restored_session(s))
            if job.ephemeral:
                self.backend.forget(job.session_id, job.tenant)
        except BaseException:
            log.exception(failed, job.session_id[:64])

    def abort(self, s: Turn, exc: BaseException) -> None:
        """Forget the turn's half-written step, then fail its request with `exc`."""
        self._abort_session(s, "abort failed for session %s")
        if s.restored is not None:
            self._release_l1(s)
        self.report(s, exc)

    def report(self, s: Turn, exc: BaseException) -> None:
        """The request fails with `exc` (`report_failure`)."""
        report_failure(s, exc, self._on_error)

    def error(self, exc: BaseException) -> None:
        """`on_error` hears of `exc` (`notify`)."""
        notify(self._on_error, exc)


def notify(on_error: Callable[[BaseException], Any] | None, exc: BaseException) -> None:
    """`on_error` hears of an error that fails a request or a commit."""
    if on_error is None:
        return
    try:
        on_error(exc)
    except Exception:  # the request's own failure goes on to its client regardless
        log.exception("handling a failed request's error failed")


def report_failure(
    s: Turn, exc: BaseException, on_error: Callable[[BaseException], Any] | None
) -> None:
    """The request fails with `exc`: its stream and its future say so, and `on_error` hears of
    it (a restore's, a step's or a commit's: once more for a step's, which is idempotent)."""
    notify(on_error, exc)
    if isinstance(exc, KvtierError):
        log.warning("session %s: %s: %s", s.job.session_id[:64], type(exc).__name__, exc)
    else:
        log.error("generation failed for session %s: %r", s.job.session_id[:64], exc)
    s.stream.put(Failed(exc))
    if not s.done.done():
        s.done.set_result(None)
