"""One parsed scrape of a /metrics endpoint, and the arithmetic kvtop does across scrapes.

Pure: text in, values out. Rates are computed from two scrapes passed in explicitly (never from
hidden state), the way Prometheus' `rate()` does over two samples; a counter that went down (the
process restarted) gives no rate for that interval rather than a negative one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvtier.errors import KvtierError

Labels = tuple[tuple[str, str], ...]


class MetricsFormatError(KvtierError, ValueError):
    """The endpoint answered, but not with the Prometheus text format."""


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape: sample name -> sorted label pairs -> value."""

    taken_at: float  # time.monotonic() seconds, for rates
    samples: Mapping[str, Mapping[Labels, float]]

    def get(self, name: str, **labels: str) -> float | None:
        """The sample with exactly these labels, or None."""
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())))

    def series(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """Every sample of `name` whose labels include `labels`, in exposition order."""
        want = labels.items()
        out = []
        for key, value in self.samples.get(name, {}).items():
            d = dict(key)
            if all(d.get(k) == v for k, v in want):
                out.append((d, value))
        return out

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the matching samples; None when there is none."""
        found = self.series(name, **labels)
        return sum(v for _, v in found) if found else None

    def label_values(self, name: str, label: str) -> list[str]:
        """Distinct values of `label` on `name`, in first-seen order."""
        seen: dict[str, None] = {}
        for key in self.samples.get(name, {}):
            for k, v in key:
                if k == label:
                    seen.setdefault(v, None)
        return list(seen)

    def has(self, name: str) -> bool:
        return bool(self.samples.get(name))


def parse(text: str, taken_at: float) -> Scrape:
    """Parse the Prometheus text exposition format (what every /metrics here serves)."""
    samples: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    except (ValueError, TypeError, IndexError) as exc:
        first = text.lstrip()[:60].replace("\n", " ")
        raise MetricsFormatError(
            f"the answer is not Prometheus text format ({exc}); it starts with {first!r}. "
            "Point --url at a kvtier serve or kvtier exporter"
        ) from None
    return Scrape(taken_at, samples)


def increase(
    before: Scrape | None, after: Scrape, name: str, labels: Labels = ()
) -> tuple[float, float] | None:
    """(increase of a counter, seconds between the scrapes); None without both samples, with no
    time between them, or when the counter went down (a restart in between)."""
    if before is None:
        return None
    dt = after.taken_at - before.taken_at
    a = before.samples.get(name, {}).get(labels)
    b = after.samples.get(name, {}).get(labels)
    if a is None or b is None or dt <= 0 or b < a:
        return None
    return b - a, dt


def rate(before: Scrape | None, after: Scrape, name: str, **labels: str) -> float | None:
    """Per-second rate of a counter between two scrapes (see `increase`)."""
    inc = increase(before, after, name, tuple(sorted(labels.items())))
    return None if inc is None else inc[0] / inc[1]


def rate_sum(before: Scrape | None, after: Scrape, name: str, **labels: str) -> float | None:
    """Per-second rate of the sum of every series of `name` matching `labels`."""
    if before is None:
        return None
    total, seen = 0.0, False
    for d, _ in after.series(name, **labels):
        r = rate(before, after, name, **d)
        if r is not None:
            total += r
            seen = True
    return total if seen else None


def buckets(scrape: Scrape, name: str, **labels: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) pairs of a histogram's `_bucket` series, sorted."""
    out = []
    for d, v in scrape.series(f"{name}_bucket", **labels):
        out.append((float(d["le"]), v))
    out.sort()
    return out


def bucket_delta(
    before: list[tuple[float, float]], after: list[tuple[float, float]]
) -> list[tuple[float, float]] | None:
    """Observations between two readings of one histogram; None after a reset or a bucket change."""
    if [b for b, _ in before] != [b for b, _ in after]:
        return None
    out = [(b, a - p) for (b, p), (_, a) in zip(before, after, strict=True)]
    return None if any(c < 0 for _, c in out) else out


def quantile(q: float, cumulative: Iterable[tuple[float, float]]) -> float | None:
    """`histogram_quantile(q, ...)` as Prometheus computes it: linear inside the bucket that
    holds the rank; a rank in the +Inf bucket gives the highest finite bound."""
    pairs = list(cumulative)
    if not pairs or pairs[-1][1] <= 0:
        return None
    rank = q * pairs[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in pairs:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
