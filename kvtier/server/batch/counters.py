"""The batch's figures for /metrics, through whichever of them a metrics object takes.

The server passes its `ServerMetrics`, which takes all of them; a bench passes its step log,
which takes some; a test none. `Counters` asks once which ones it takes, so that the parts call
it without asking again.
"""

from __future__ import annotations

from typing import Any


class Counters:
    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self._count = getattr(metrics, "count", None)
        self._commit_failure = getattr(metrics, "commit_failure", None)
        self._ttft = getattr(metrics, "ttft", None)
        self._pages = getattr(metrics, "pages", None)

    def count(self, name: str, n: int = 1) -> None:
        """`kvtier_server_<name>_total` and its kind (tokens, parked turns, shared pages)."""
        if self._count is not None:
            self._count(name, n)

    def commit_failure(self, reason: str) -> None:
        """A commit that failed after its reply was generated (`kvtier_commit_failures_total`)."""
        if self._commit_failure is not None:
            self._commit_failure(reason)

    def ttft(self, source: str, seconds: float) -> None:
        """A turn's time to its first token, by where its prefix came from."""
        if self._ttft is not None:
            self._ttft(source, seconds)

    def pages(self, parked: int, free: int, total: int, page_bytes: int) -> None:
        """The pool's pages by state."""
        if self._pages is not None:
            self._pages(parked, free, total, page_bytes)
