"""A circuit breaker for the L4 client: after failures, stop calling Redis for a while.

closed: calls go through; `threshold` failures in a row open it. open: calls are refused at
once (the caller treats that as a miss or a shed write) until `retry_at`; then one caller gets
to probe (half_open). A probe that succeeds closes the breaker; one that fails opens it again
with the backoff doubled, up to `max_backoff_s`. Pure (no I/O); the clock is injectable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(
        self,
        *,
        threshold: int = 2,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self.failures = 0  # in a row
        self.opened = 0  # times it opened
        self._backoff = backoff_s
        self.retry_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to Redis now; in `open`, past the backoff, the first caller
        becomes the probe (state half_open) and the others keep being refused."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() >= self.retry_at:
                self.state = HALF_OPEN
                return True
            return False

    def probe_due(self) -> bool:
        with self._lock:
            return self.state == OPEN and self._clock() >= self.retry_at

    def success(self) -> None:
        with self._lock:
            self.state = CLOSED
            self.failures = 0
            self._backoff = self.backoff_s

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN:
                self._backoff = min(self.max_backoff_s, self._backoff * 2)
                self._open()
            elif self.state == CLOSED and self.failures >= self.threshold:
                self._open()
            elif self.state == OPEN:
                self.retry_at = max(self.retry_at, self._clock() + self._backoff)

    def probe_failed(self) -> None:
        """A call ended without a verdict on Redis (an error of another kind): where it was the
        probe, that is a failure, else nothing. A half-open breaker whose probe got no verdict
        would refuse every later call."""
        with self._lock:
            if self.state == HALF_OPEN:
                self.failures += 1
                self._backoff = min(self.max_backoff_s, self._backoff * 2)
                self._open()

    def trip(self) -> None:
        """Open now (the server is gone for sure: connection refused)."""
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN:
                self._backoff = min(self.max_backoff_s, self._backoff * 2)
            if self.state != OPEN:
                self._open()

    def _open(self) -> None:
        self.state = OPEN
        self.opened += 1
        self.retry_at = self._clock() + self._backoff
