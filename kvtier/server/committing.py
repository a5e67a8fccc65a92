"""The end of a batched turn off the scheduler thread: its commit, or its abort, and the events
that close its stream.

A finished turn's new K/V goes to the cache here, on a small pool of commit threads, so that
restores and commits never stall the batch: with paged L1 its chunks gathered from the pages
are stored (`commit_pages`), else the K/V copied out of the pages is appended to the session's
Cache and committed, exactly as the per-request worker does. Either way: abort on error,
hibernate on cancel, forget when ephemeral.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from kvtier.errors import KvtierError
from kvtier.server.backend import Backend, PagedBackend
from kvtier.server.jobs import Failed, Finished
from kvtier.server.pagecopy import append_kv

log = logging.getLogger("kvtier.server")


class TurnCommits:
    """Commits and aborts of finished turns on `threads` commit threads (`executor`).

    `release_l1(s)` is told when a restored turn's session may leave L1 again, `count(name, n)`
    counts tokens for /metrics, and `on_error(exc)` hears of every error that fails a request
    (the engine's: a lost device stops the server)."""

    def __init__(
        self,
        backend: Backend,
        paged: PagedBackend | None,
        chunk_tokens: int,
        threads: int,
        release_l1: Callable[[Any], None],
        count: Callable[[str, int], None],
        on_error: Callable[[BaseException], Any] | None = None,
    ) -> None:
        self.backend = backend
        self.paged = paged
        self.chunk_tokens = chunk_tokens
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, "kvtier-commit")
        self._release_l1 = release_l1
        self._count = count
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

    def commit(self, s: Any, reason: str, fed: int, new: Any) -> None:
        """Store the turn's K/V (its first `fed` tokens), then close its stream."""
        job, backend = s.job, self.backend
        assert s.restored is not None
        try:
            if self.paged is not None:
                if new is None:  # nothing to store (an int8 pool): the stored prefix stays
                    backend.abort(job.session_id, job.tenant)
                else:
                    start, chunks = new
                    upto = fed
                    if job.ephemeral:  # forgotten next: its full chunks alone, as before
                        upto = max(start, fed // self.chunk_tokens * self.chunk_tokens)
                        chunks = chunks[: (upto - start) // self.chunk_tokens]
                    self.paged.commit_pages(
                        job.session_id, job.tenant, s.tokens[:upto], start, chunks
                    )
            else:
                if new is not None:
                    append_kv(s.restored.kv, new)
                # Commit what the KV now covers, also after a disconnect: a returning client finds it.
                backend.commit(job.session_id, job.tenant, s.tokens[:fed])
            if job.ephemeral:
                backend.forget(job.session_id, job.tenant)
            elif reason == "cancelled":
                backend.hibernate(job.session_id, job.tenant)  # the client went away: free its L1
        except BaseException as exc:
            self.abort(s, exc)
            return
        total = len(job.prompt_ids)
        if not job.internal:
            self._count("completion_tokens", len(s.reply.ids))
            self._count("prompt_tokens", total)
        self._release_l1(s)
        s.stream.put(
            Finished(reason, total, len(s.reply.ids), s.restored.covered, s.restored.source)
        )
        s.done.set_result(None)

    def abort(self, s: Any, exc: BaseException) -> None:
        """Forget the turn's half-written step, then fail its request with `exc`."""
        job = s.job
        try:
            self.backend.abort(job.session_id, job.tenant)  # forget the half-written step
            if job.ephemeral:
                self.backend.forget(job.session_id, job.tenant)
        except BaseException:
            log.exception("abort failed for session %s", job.session_id[:64])
        if s.restored is not None:
            self._release_l1(s)
        self.report(s, exc)

    def report(self, s: Any, exc: BaseException) -> None:
        """The request fails with `exc`: its stream and its future say so."""
        self.error(exc)  # a restore's or a commit's (once more for a step's: idempotent)
        if isinstance(exc, KvtierError):
            log.warning("session %s: %s: %s", s.job.session_id[:64], type(exc).__name__, exc)
        else:
            log.error("generation failed for session %s: %r", s.job.session_id[:64], exc)
        s.stream.put(Failed(exc))
        if not s.done.done():
            s.done.set_result(None)

    def error(self, exc: BaseException) -> None:
        if self._on_error is None:
            return
        try:
            self._on_error(exc)
        except Exception:  # the request's own failure goes on to its client regardless
            log.exception("handling a failed request's error failed")
