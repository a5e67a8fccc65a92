"""Free ranges of a fixed slab, in whole units: best fit, and neighbours merge when freed.

L1 carves every session's block out of one preallocated slab (kvtier/tiers/l1.py); this is the
bookkeeping. Pure Python, no tensors.
"""

from __future__ import annotations

import bisect


class Extents:
    """The free ranges of `units` units, as sorted, non-adjacent ``(offset, length)`` pairs."""

    def __init__(self, units: int) -> None:
        if units < 0:
            raise ValueError(f"a slab of {units} units")
        self.units = units
        self._free: list[tuple[int, int]] = [(0, units)] if units else []

    @property
    def free_units(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def largest(self) -> int:
        """The longest free range, in units (0 when none is free)."""
        return max((n for _, n in self._free), default=0)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(self._free)

    def take(self, n: int) -> int | None:
        """The offset of `n` contiguous units, now taken; None when no free range is that long.

        Best fit: the shortest free range that holds `n` (the lowest offset among equals), so
        long ranges stay whole for long requests."""
        if n <= 0:
            raise ValueError(f"take({n}): a range is at least one unit")
        best = -1
        for i, (_, length) in enumerate(self._free):
            if length >= n and (best < 0 or length < self._free[best][1]):
                best = i
                if length == n:
                    break
        if best < 0:
            return None
        offset, length = self._free[best]
        if length == n:
            del self._free[best]
        else:
            self._free[best] = (offset + n, length - n)
        return offset

    def give(self, offset: int, n: int) -> None:
        """Free `n` units at `offset` (taken before); they merge with free neighbours."""
        if n <= 0 or offset < 0 or offset + n > self.units:
            raise ValueError(f"give({offset}, {n}) is outside the slab of {self.units} units")
        i = bisect.bisect_left(self._free, (offset, 0))
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        if (before is not None and before[0] + before[1] > offset) or (
            after is not None and offset + n > after[0]
        ):
            raise ValueError(f"give({offset}, {n}): part of that range is free already")
        if before is not None and before[0] + before[1] == offset:
            offset, n = before[0], before[1] + n
            i -= 1
            del self._free[i]
        if after is not None and offset + n == after[0]:
            n += after[1]
            del self._free[i]
        self._free.insert(i, (offset, n))
