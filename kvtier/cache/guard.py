"""CacheGuard: the one lock of a TieredCache, and what waits on it.

Every part of the cache that changes shared state (sessions, the chunk directory, the
counters) does it holding this lock; the parts marked "caller holds the guard" never take it
themselves. It is re-entrant, held only for bookkeeping and for starting transfers, never
across a wait for the disk (docs/architecture.md, "Lock discipline").

Besides the lock it counts the restores between their plan and their publish (their load
phase runs outside the lock) so that `close` and an L1 move wait for them, and it knows
whether the cache is closed.
"""

from __future__ import annotations

import threading

from kvtier.errors import SessionError


class CacheGuard:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a restore publishes
        self._loading = 0  # restores between their plan and their publish
        self._closed = False

    def __enter__(self) -> CacheGuard:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise SessionError("this TieredCache is closed")

    def mark_closed(self) -> None:
        """(guard held) From now on `check_open` refuses."""
        self._closed = True

    def begin_load(self) -> None:
        """(guard held) A restore leaves its plan for its load phase, outside the lock."""
        self._loading += 1

    def end_load(self) -> None:
        """(guard held) A restore is back from its load phase: waiters may go on."""
        self._loading -= 1
        self._idle.notify_all()

    def wait_loads(self) -> None:
        """(guard held) Wait until no restore is in its load phase (they copy into L1)."""
        while self._loading:
            self._idle.wait()
