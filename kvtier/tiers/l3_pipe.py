"""Overlap machinery of the L3 store: a payload checksum that runs beside the reads, and a group
commit that shares one rename/directory-fsync/index step among concurrent writers.

Both exist for throughput only; neither changes what a read verifies or when a write is durable
(see docs/benchmarks.md, "L3 store", for the measurements that justify them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any, Generic, TypeVar

from kvtier import kvbin

T = TypeVar("T")


class ChecksumStream:
    """CRC of a payload fed piece by piece, computed on a worker thread in feed order.

    The caller reads piece k+1 from the device while the worker checksums piece k (both calls
    release the GIL), so a verified read costs about the read alone. `result()` always waits for
    the worker, so no piece of the caller's buffer is touched after the read returns.
    """

    def __init__(self, pool: Executor, algo: str) -> None:
        self._algo = algo
        self._pieces: SimpleQueue[memoryview | None] = SimpleQueue()
        self._done: Future[int] = pool.submit(self._run)
        self._closed = False

    def _run(self) -> int:
        value = 0
        while (piece := self._pieces.get()) is not None:
            value = kvbin.checksum(self._algo, piece, value)
        return value

    def feed(self, piece: memoryview) -> None:
        self._pieces.put(piece)

    def result(self) -> int:
        """The CRC of everything fed (waits for the worker to finish)."""
        if not self._closed:
            self._closed = True
            self._pieces.put(None)
        return self._done.result()

    def cancel(self) -> None:
        """Stop after the pieces already fed and wait, so the caller may reuse its buffer."""
        if not self._closed:
            self._closed = True
            self._pieces.put(None)
        self._done.exception()


@dataclass
class _Entry(Generic[T]):
    item: T
    done: bool = False
    error: BaseException | None = None
    extra: Any = field(default=None)


class GroupCommit(Generic[T]):
    """Leader-based group commit: concurrent `submit` calls are applied together in one batch.

    The first caller that finds no batch in flight becomes the leader and applies every pending
    item with one call of `apply`; the others wait for it. `apply` returns one error (or None) per
    item; `submit` raises its item's error and returns only after the batch holding it was applied,
    so each caller keeps the same guarantee as if it had committed alone.
    """

    def __init__(self, apply: Callable[[list[T]], list[BaseException | None]]) -> None:
        self._apply = apply
        self._cond = threading.Condition()
        self._pending: list[_Entry[T]] = []
        self._busy = False
        self.batches = 0  # batches applied (for tests and the benchmark)
        self.items = 0

    def submit(self, item: T) -> None:
        entry: _Entry[T] = _Entry(item)
        with self._cond:
            self._pending.append(entry)
            while not entry.done and self._busy:
                self._cond.wait()
            if entry.done:
                if entry.error is not None:
                    raise entry.error
                return
            self._busy = True
            group, self._pending = self._pending, []
        try:
            errors = self._apply([e.item for e in group])
        except BaseException as exc:  # apply itself failed: every item of the batch fails
            errors = [exc] * len(group)
        with self._cond:
            for e, err in zip(group, errors, strict=True):
                e.error, e.done = err, True
            self.batches += 1
            self.items += len(group)
            self._busy = False
            self._cond.notify_all()
        if entry.error is not None:
            raise entry.error
