"""The scrapes kvtop keeps: the last minute at full rate (sparklines) and a sparse longer record
(the look-back windows of the alert rules). Pure: scrapes come in, nothing is read here."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from ops.kvtop.metrics import Scrape

SPARK_WINDOW_S = 60.0  # "the last minute" of the tiers panel's sparklines
LONG_WINDOW_S = 1800.0  # the longest alert look-back kvtop judges over (30 min)
LONG_STEP_S = 15.0  # one kept scrape per 15 s beyond the last minute


class History:
    """Scrapes in time order. `add` prunes; rates are always between scrapes passed around."""

    def __init__(
        self,
        window_s: float = SPARK_WINDOW_S,
        long_window_s: float = LONG_WINDOW_S,
        long_step_s: float = LONG_STEP_S,
    ) -> None:
        self.window_s = window_s
        self.long_window_s = long_window_s
        self.long_step_s = long_step_s
        self._recent: deque[Scrape] = deque()
        self._long: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        if self._recent and scrape.taken_at <= self._recent[-1].taken_at:
            return  # a clock that did not move gives no rate; keep the first reading
        self._recent.append(scrape)
        # keep one scrape at or before the window's start so the oldest interval has a rate
        while len(self._recent) > 2 and scrape.taken_at - self._recent[1].taken_at >= self.window_s:
            old = self._recent.popleft()
            if not self._long or old.taken_at - self._long[-1].taken_at >= self.long_step_s:
                self._long.append(old)
        while self._long and scrape.taken_at - self._long[0].taken_at > self.long_window_s:
            self._long.popleft()

    def clear(self) -> None:
        """Forget everything (the source changed, e.g. after the endpoint restarted)."""
        self._recent.clear()
        self._long.clear()

    @property
    def latest(self) -> Scrape | None:
        return self._recent[-1] if self._recent else None

    @property
    def previous(self) -> Scrape | None:
        return self._recent[-2] if len(self._recent) > 1 else None

    def __len__(self) -> int:
        return len(self._recent) + len(self._long)

    def baseline(self, window_s: float) -> Scrape | None:
        """The oldest kept scrape no more than `window_s` before the latest (not the latest)."""
        latest = self.latest
        if latest is None:
            return None
        for s in (*self._long, *self._recent):
            if latest.taken_at - s.taken_at <= window_s:
                return s if s is not latest else None
        return None

    def points(self, window_s: float) -> list[Scrape]:
        """Every kept scrape within `window_s` of the latest, oldest first."""
        latest = self.latest
        if latest is None:
            return []
        return [s for s in (*self._long, *self._recent) if latest.taken_at - s.taken_at <= window_s]

    def window(self) -> list[Scrape]:
        """The scrapes of the last minute (and the one before it), oldest first: what `spark`
        pairs up."""
        return list(self._recent)

    def spark(self, fn: Callable[[Scrape, Scrape], float | None]) -> list[float]:
        """`fn(before, after)` for each consecutive pair of the last minute (None -> 0)."""
        items = list(self._recent)
        return [fn(a, b) or 0.0 for a, b in itertools.pairwise(items)]
