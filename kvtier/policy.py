"""Eviction policies: small pure objects (no torch, no I/O, no metrics).

A policy tracks keys it is told about and, when asked, names the victim to evict next. The
cache owns the data; the policy only orders keys. Every policy satisfies the same contract
(`tests/kvtier/test_policy.py` runs one suite over all of them):

- `touch(key)` records a use (inserting the key if new);
- `remove(key)` forgets it (a no-op for unknown keys);
- `victim(exclude)` returns the key to evict next that is not in `exclude`, or None;
- `len(policy)` and `key in policy` work as for a set.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def victim(self, exclude: Container[Hashable] = ()) -> Hashable | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, exclude: Container[Hashable] = ()) -> Hashable | None:
        return next((k for k in self._order if k not in exclude), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LFU:
    """Least frequently used first; ties broken by least recent use.

    A lazy-deletion heap keeps `touch` and `victim` O(log n) amortised.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[Hashable, tuple[int, int]] = {}  # key -> (count, last tick)
        self._heap: list[tuple[int, int, int, Hashable]] = []
        self._tick = itertools.count()
        self._uid = itertools.count()  # heap tiebreak: keys need not be orderable

    def touch(self, key: Hashable) -> None:
        count = self._freq.get(key, (0, 0))[0] + 1
        tick = next(self._tick)
        self._freq[key] = (count, tick)
        heapq.heappush(self._heap, (count, tick, next(self._uid), key))

    def remove(self, key: Hashable) -> None:
        self._freq.pop(key, None)

    def victim(self, exclude: Container[Hashable] = ()) -> Hashable | None:
        skipped = []
        found = None
        while self._heap:
            count, tick, uid, key = heapq.heappop(self._heap)
            if self._freq.get(key) != (count, tick):
                continue  # stale entry: the key was touched again or removed
            skipped.append((count, tick, uid, key))
            if key not in exclude:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._freq) + 64:  # compact stale entries
            self._heap = [(c, t, next(self._uid), k) for k, (c, t) in self._freq.items()]
            heapq.heapify(self._heap)
        return found

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
