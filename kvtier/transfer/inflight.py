"""Device memory that copies still in flight hold outside the L1 pool's budget, under one bound.

A copy down (L1 -> L2) reads device memory that can leave the L1 pool's accounting before the
copy is done:

- an L1 block released (the session evicted, hibernated or closed) or replaced by a larger one
  (the session grew) while its chunks are still going down: the allocator keeps the block until
  the copy's stream is past it (`record_stream`), so it is not free yet;
- a chunk gathered from a batch's pages for `offload_chunk`, in one of the ledger's gather
  buffers (`GatherBuffers`: allocated once, at most `max_bytes` of them, reused), busy until its
  copy is done.

`Inflight` counts those bytes from the moment they would otherwise be unaccounted until the
copy's `Handle` is done, and keeps them under `max_bytes`: taking room past the bound first
waits for the oldest copies to finish (backpressure; every wait is reported to `on_wait` with
its seconds). A released block larger than the bound on its own is not counted: its release
waits for its own copy instead. So kvtier's device memory is at most the L1 budget, the staging
buffers and `max_bytes`, whatever the disk's speed or the number of sessions.

On a CPU device every copy is done when it returns, so nothing stays in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# Backpressure polls at this period while the only copies holding room have no Handle yet
# (another thread is between taking room and issuing its copy).
_POLL_S = 0.001


class Ticket:
    """Room taken in an `Inflight` ledger: `nbytes`, held until `handle` (its copy) is done.
    `handle` is None between taking the room and issuing the copy; `done` is set (under the
    ledger's lock) once the room is given back, so that what the room stood for may be used
    again (a gather buffer, `GatherBuffers`)."""

    __slots__ = ("done", "handle", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.handle: Any = None
        self.done = False


def _done(handle: Any) -> bool:
    try:
        return bool(handle.done())
    except Exception:  # a lost device raises from its events: nothing of it is held any more
        return True


def _wait(handle: Any) -> None:
    try:
        handle.wait()
    except Exception:  # as in _done
        pass


class Inflight:
    """The ledger of device bytes held by copies in flight (see the module docstring)."""

    def __init__(self, max_bytes: int, on_wait: Callable[[float], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the in-flight bound must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.on_wait = on_wait  # called with the seconds of each backpressure wait
        self._cond = threading.Condition(threading.Lock())
        self._tickets: list[Ticket] = []
        self._bytes = 0
        self.peak_bytes = 0  # the most ever held at once

    # -- reading ---------------------------------------------------------------------------------

    def bytes(self) -> int:
        """Device bytes copies in flight hold now (finished copies are dropped first)."""
        with self._cond:
            self._reap()
            return self._bytes

    def _reap(self) -> None:
        """Drop the tickets whose copy is done (the caller holds the condition's lock)."""
        if not self._tickets:
            return
        keep = []
        for t in self._tickets:
            if t.handle is not None and _done(t.handle):
                self._bytes -= t.nbytes
                t.done = True
            else:
                keep.append(t)
        if len(keep) != len(self._tickets):
            self._tickets = keep
            self._cond.notify_all()

    # -- taking room -----------------------------------------------------------------------------

    def take(self, nbytes: int) -> Ticket | None:
        """Room for `nbytes` more, waiting for the oldest copies in flight while they would pass
        the bound; None when `nbytes` alone is more than the bound (nothing is taken)."""
        nbytes = int(nbytes)
        if nbytes > self.max_bytes:
            return None
        waited = 0.0
        try:
            while True:
                with self._cond:
                    self._reap()
                    if self._bytes + nbytes <= self.max_bytes:
                        ticket = Ticket(nbytes)
                        self._tickets.append(ticket)
                        self._bytes += nbytes
                        self.peak_bytes = max(self.peak_bytes, self._bytes)
                        return ticket
                    oldest = next((t.handle for t in self._tickets if t.handle is not None), None)
                    if oldest is None:  # room taken, copies not issued yet: they will be soon
                        t0 = time.perf_counter()
                        self._cond.wait(_POLL_S)
                        waited += time.perf_counter() - t0
                        continue
                t0 = time.perf_counter()
                _wait(oldest)  # outside the ledger's lock: other threads may reap meanwhile
                waited += time.perf_counter() - t0
        finally:
            if waited and self.on_wait is not None:
                self.on_wait(waited)

    def bind(self, ticket: Ticket, handle: Any) -> None:
        """The copy that uses the ticket's room: it is given back once `handle` is done."""
        with self._cond:
            ticket.handle = handle
            self._reap()
            self._cond.notify_all()

    def give_back(self, ticket: Ticket | None) -> None:
        """Return room whose copy was never issued (an error before it)."""
        if ticket is None:
            return
        with self._cond:
            if ticket in self._tickets:
                self._tickets.remove(ticket)
                self._bytes -= ticket.nbytes
                ticket.done = True
                self._cond.notify_all()

    def retire(self, handle: Any, nbytes: int) -> None:
        """`nbytes` of device memory leave the L1 pool's accounting while `handle`'s copy may
        still use them (a released or replaced L1 block): count them until that copy is done,
        waiting for older copies at the bound, or, for memory larger than the bound alone, wait
        for that copy now. Nothing to do once the copy is done."""
        if handle is None or _done(handle):
            return
        ticket = self.take(nbytes)
        if ticket is not None:
            self.bind(ticket, handle)
            return
        t0 = time.perf_counter()
        _wait(handle)
        if self.on_wait is not None:
            self.on_wait(time.perf_counter() - t0)

    def drain(self) -> None:
        """Wait for every copy in flight (close, tests)."""
        while True:
            with self._cond:
                self._reap()
                handles = [t.handle for t in self._tickets if t.handle is not None]
                if not handles:
                    return
            for h in handles:
                _wait(h)

    def clear(self) -> None:
        """Forget every ticket (the device they were on is gone: `TransferEngine.move_device`)."""
        with self._cond:
            self._tickets = []
            self._bytes = 0
            self._cond.notify_all()
