"""kvtop's trends: a few figures over the last minute, one value per refresh, drawn as charts of
several rows where a tall terminal leaves rows that no panel's content needs (render.py).

Pure, like the model: `trends()` reads the history's last minute; `trend_lines()` draws them for
a width and a number of rows. A figure the endpoint does not export has no trend (never zeros).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from rich.text import Text

from ops.kvtop import fmt
from ops.kvtop import metrics as m
from ops.kvtop.history import History
from ops.kvtop.metrics import Scrape

CHART_ROWS = 12  # the tallest chart: more rows add little to a minute of points


@dataclass(frozen=True)
class Trend:
    name: str
    unit: str  # "s" (a duration), "/s" (a count per second), "B/s" (bytes per second)
    values: tuple[float, ...]  # one per refresh over the last minute, oldest first (none: 0)
    latest: float | None  # over the last refresh; None when it had none (no request ended)

    def show(self, x: float) -> str:
        return {"s": fmt.seconds, "/s": fmt.per_s, "B/s": fmt.rate}[self.unit](x)


def _summed_buckets(scrape: Scrape, hist: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets summed over its other labels (every source)."""
    by_le: dict[float, float] = {}
    for key, v in scrape.samples.get(f"{hist}_bucket", {}).items():
        le = float(dict(key)["le"])
        by_le[le] = by_le.get(le, 0.0) + v
    return sorted(by_le.items())


# (name, unit, counter, labels it must carry): the per-second trends of a counter's total
COUNTERS = (
    ("restores", "/s", "kvtier_restore_decisions_total", ()),
    ("tokens", "/s", "kvtier_server_completion_tokens_total", ()),
    ("L3 reads", "B/s", "kvtier_transfer_bytes_total", (("src", "l3"),)),
    ("L3 writes", "B/s", "kvtier_transfer_bytes_total", (("dst", "l3"),)),
)


def trends(history: History) -> tuple[Trend, ...]:
    """The trends the latest scrape's endpoint has figures for. Each scrape of the minute is
    summed once (a frame's budget is 30 ms: bench/kvtop.py), then consecutive ones compared."""
    cur = history.latest
    if cur is None:
        return ()
    hist = (
        "kvtier_server_ttft_seconds"
        if cur.has("kvtier_server_ttft_seconds_bucket")
        else "kvtier_restore_duration_seconds"
    )
    points = history.window()
    out = []
    if cur.has(f"{hist}_bucket"):
        summed = [_summed_buckets(p, hist) for p in points]
        p50s = []
        for before, after in itertools.pairwise(summed):
            delta = m.bucket_delta(before, after)
            p50s.append(None if delta is None else m.quantile(0.5, delta))
        name = "TTFT p50" if "ttft" in hist else "restore p50"
        out.append(Trend(name, "s", tuple(v or 0.0 for v in p50s), p50s[-1] if p50s else None))
    for name, unit, counter, want in COUNTERS:
        if not cur.has(counter):
            continue
        totals = [
            sum(v for key, v in p.samples.get(counter, {}).items() if set(want) <= set(key))
            for p in points
        ]
        rates: list[float | None] = []
        times = [p.taken_at for p in points]
        for (a, ta), (b, tb) in itertools.pairwise(zip(totals, times, strict=True)):
            rates.append((b - a) / (tb - ta) if b >= a and tb > ta else None)  # None: a restart
        out.append(Trend(name, unit, tuple(v or 0.0 for v in rates), rates[-1] if rates else None))
    return tuple(out)


def chart(values: tuple[float, ...], width: int, rows: int) -> list[str]:
    """The last `width` values as a block chart `rows` high, scaled to their maximum, top row
    first; older points the width cannot hold are dropped, a short history is right-aligned."""
    tail = list(values)[-width:] if width > 0 else []
    top = max(tail, default=0.0)
    eighths = [round(v / top * rows * 8) if top > 0 and v > 0 else 0 for v in tail]
    out = []
    for row in range(rows):
        floor = (rows - 1 - row) * 8  # eighths below this row
        line = []
        for e in eighths:
            fill = e - floor
            line.append(" " if fill <= 0 else "█" if fill >= 8 else fmt.SPARKS[fill - 1])
        out.append("".join(line).rjust(width))
    return out


def trend_lines(items: tuple[Trend, ...], width: int, rows: int) -> list[Text]:
    """As many trends as fit in `rows` lines of `width` cells: each a title line (its latest
    value and the minute's highest) over a chart of up to CHART_ROWS rows."""
    if rows < 2 or not items:
        return []
    shown = items[: rows // 2]
    height = min(CHART_ROWS, rows // len(shown) - 1)
    lines: list[Text] = []
    for t in shown:
        peak = max(t.values, default=0.0)
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f"{t.name} ", style="bold")
        per = "/s" if t.unit == "/s" else ""  # fmt.rate says /s itself; a duration has none
        title.append("-" if t.latest is None else f"{t.show(t.latest)}{per}")
        title.append(f"  (last 1m, max {t.show(peak)}{per})", style="dim")
        lines.append(title)
        lines += [Text(row, style="cyan", no_wrap=True) for row in chart(t.values, width, height)]
    return lines
