"""Group commit of the L3 store: concurrent writers share one rename/directory-fsync/index step.

A durable put ends with three device flushes (its file, its directory, the index's WAL); when
several writer threads put at once, one commit can cover all of them. This is for throughput
only: each `submit` still returns only after its own items were applied (docs/benchmarks.md,
"L3 store", has the measurements).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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
