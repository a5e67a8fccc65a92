"""The cache's upkeep thread: what must happen while no request calls the cache.

Every `period` seconds it calls `tick()` (the cache's: harvest finished writes, forget idle
sessions, queue shed L3 writes again). A tick that returns futures (writes in flight, while
some chunk's shed write still waits for room in the queue) is called again as soon as one of
them is done, so that a committed chunk reaches L3 within `CacheConfig.l3_write_bound_s` of
its commit while the disk keeps up, even on a server that no request reaches any more.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

log = logging.getLogger("kvtier.cache")


class Upkeep:
    """A daemon thread calling `tick`, a bound method (see the module docstring), until `stop`
    or until its object is gone: the thread holds it weakly, so a cache never closed can still
    be collected."""

    def __init__(self, period: float, tick: Callable[[], list[Future[Any]]]) -> None:
        self.period = period
        self._ref = weakref.WeakMethod(tick)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-upkeep", daemon=True)
        self._thread.start()

    def _tick(self) -> list[Future[Any]] | None:
        tick = self._ref()
        return None if tick is None else tick()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                waits = self._tick()
                while waits and not self._stop.is_set():
                    wait(waits, timeout=self.period, return_when=FIRST_COMPLETED)
                    waits = self._tick()
            except Exception:  # never lost: the next period tries again
                log.exception("cache upkeep failed")
                continue
            if waits is None:
                return  # the cache is gone

    def stop(self) -> None:
        """Stop after the tick in progress, if any (no wait: the tick may need the cache's
        lock, which the caller may hold)."""
        self._stop.set()
