"""The server's side of a load run, read from its /metrics text: the TTFT histogram's increase
between two scrapes (`kvtier_server_ttft_seconds`, by restore source) and its quantiles as
Prometheus' `histogram_quantile` computes them. Pure: text in, numbers out."""

from __future__ import annotations

import math
from typing import Any

SOURCE_ORDER = ("l1", "l2", "l3", "l4", "recompute")
TTFT_METRIC = "kvtier_server_ttft_seconds"  # kvtier/server/metrics.py, label `src`


def _source_key(src: str) -> tuple[int, str]:
    return (SOURCE_ORDER.index(src) if src in SOURCE_ORDER else len(SOURCE_ORDER), src)


# ---- /metrics ------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _histograms(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """{src: {"buckets": {le: cumulative count}, "count": n, "sum": seconds}} of the TTFT metric."""
    out: dict[str, dict[str, Any]] = {}
    for labels, value in samples.get(TTFT_METRIC + "_bucket", []):
        h = out.setdefault(labels.get("src", "?"), {"buckets": {}, "count": 0.0, "sum": 0.0})
        h["buckets"][float(labels["le"])] = value
    for part in ("count", "sum"):
        for labels, value in samples.get(f"{TTFT_METRIC}_{part}", []):
            h = out.setdefault(labels.get("src", "?"), {"buckets": {}, "count": 0.0, "sum": 0.0})
            h[part] = value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding rank q * count.
    q in 0..1; `buckets` maps upper bound -> cumulative count. None when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # above the largest finite bound: that bound is all one knows
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower  # pragma: no cover (the +Inf bucket holds every observation)


def server_ttft(before: str | None, after: str) -> dict[str, Any]:
    """Server-side TTFT ("overall" and by source) over the interval between two /metrics
    texts, in ms: n, p50 and p95 (interpolated within the buckets) and the exact mean.

    Counters restart at zero when the server restarts; a negative difference means that, and
    then the later text is taken alone."""
    return ttft_summary(ttft_deltas(before, after))


def ttft_deltas(before: str | None, after: str) -> dict[str, dict[str, Any]]:
    """The TTFT histogram's increase by source between two /metrics texts of one server."""
    old = _histograms(parse_metrics(before)) if before else {}
    new = _histograms(parse_metrics(after))
    deltas: dict[str, dict[str, Any]] = {}
    for src, h in new.items():
        o = old.get(src, {"buckets": {}, "count": 0.0, "sum": 0.0})
        if h["count"] < o["count"]:
            o = {"buckets": {}, "count": 0.0, "sum": 0.0}
        if h["count"] - o["count"] <= 0:
            continue
        deltas[src] = {
            "buckets": {le: c - o["buckets"].get(le, 0.0) for le, c in h["buckets"].items()},
            "count": h["count"] - o["count"],
            "sum": h["sum"] - o["sum"],
        }
    return deltas


def ttft_summary(deltas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`server_ttft`'s figures from histogram increases by source (of one server or summed)."""
    if not deltas:
        return {}
    overall: dict[str, Any] = {"buckets": {}, "count": 0.0, "sum": 0.0}
    for d in deltas.values():
        for le, c in d["buckets"].items():
            overall["buckets"][le] = overall["buckets"].get(le, 0.0) + c
        overall["count"] += d["count"]
        overall["sum"] += d["sum"]
    out: dict[str, Any] = {}
    for src, d in [
        ("overall", overall),
        *sorted(deltas.items(), key=lambda kv: _source_key(kv[0])),
    ]:
        p50, p95 = (histogram_quantile(q, d["buckets"]) for q in (0.5, 0.95))
        out[src] = {
            "n": int(d["count"]),
            "p50": None if p50 is None else p50 * 1000,
            "p95": None if p95 is None else p95 * 1000,
            "mean": d["sum"] / d["count"] * 1000,
        }
    return out
