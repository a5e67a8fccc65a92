"""kvtop's L4 (Redis) row: the figures from the `kvtier_l4_*` families, and the line drawn.

Pure, like the rest of kvtop: scrapes in, an `L4View` out (None when the endpoint has no L4,
so the row is hidden rather than shown as zeros), and its whole fields flowed into a width.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text

from ops.kvtop import fmt
from ops.kvtop import metrics as m
from ops.kvtop.metrics import Scrape

# kvtier_l4_breaker_state values (ops.exporter.l4.BREAKER_STATES), as the screen names them
BREAKER = {0.0: "closed", 1.0: "half open", 2.0: "open"}
LATENCY = "kvtier_l4_operation_seconds"


@dataclass(frozen=True)
class L4View:
    up: bool
    breaker: str | None  # "closed", "half open", "open"; None when not exported
    hits: float | None
    misses: float | None
    hit_ratio: float | None  # over the last minute when it had lookups, else since start
    used: float | None  # Redis's used memory (the l4 tier's used bytes), when exported
    capacity: float | None  # its maxmemory; 0: no limit
    read_rate: float | None  # bytes/s over the last refresh
    write_rate: float | None
    get_seconds: float | None  # mean get latency over the last refresh, else since start
    put_seconds: float | None
    errors: float | None
    errors_rate: float | None
    shed: float | None


def _mean(cur: Scrape, prev: Scrape | None, op: str) -> float | None:
    """Mean latency of `op` over the last refresh; since start when none ran in it."""
    count = m.increase(prev, cur, f"{LATENCY}_count", (("op", op),))
    total = m.increase(prev, cur, f"{LATENCY}_sum", (("op", op),))
    if count is not None and total is not None and count[0] > 0:
        return total[0] / count[0]
    n, s = cur.get(f"{LATENCY}_count", op=op), cur.get(f"{LATENCY}_sum", op=op)
    return s / n if n and s is not None else None


def _ratio(hits: float | None, misses: float | None) -> float | None:
    if hits is None or misses is None or hits + misses <= 0:
        return None
    return hits / (hits + misses)


def l4_view(cur: Scrape, prev: Scrape | None, minute: Scrape | None) -> L4View | None:
    """The L4 row's figures, or None when the scrape has no L4 (none configured)."""
    up = cur.get("kvtier_l4_up")
    if up is None:
        return None
    hits, misses = cur.get("kvtier_l4_hits_total"), cur.get("kvtier_l4_misses_total")
    ratio = _ratio(hits, misses)
    h = m.increase(minute, cur, "kvtier_l4_hits_total")
    x = m.increase(minute, cur, "kvtier_l4_misses_total")
    if h is not None and x is not None and _ratio(h[0], x[0]) is not None:
        ratio = _ratio(h[0], x[0])
    breaker = cur.get("kvtier_l4_breaker_state")
    return L4View(
        up=up > 0,
        breaker=None if breaker is None else BREAKER.get(breaker, f"{breaker:g}"),
        hits=hits,
        misses=misses,
        hit_ratio=ratio,
        used=cur.get("kvtier_tier_used_bytes", tier="l4"),
        capacity=cur.get("kvtier_tier_capacity_bytes", tier="l4"),
        read_rate=m.rate(prev, cur, "kvtier_l4_bytes_total", direction="read"),
        write_rate=m.rate(prev, cur, "kvtier_l4_bytes_total", direction="written"),
        get_seconds=_mean(cur, prev, "get"),
        put_seconds=_mean(cur, prev, "put"),
        errors=cur.get("kvtier_l4_errors_total"),
        errors_rate=m.rate(prev, cur, "kvtier_l4_errors_total"),
        shed=cur.get("kvtier_l4_writes_shed_total"),
    )


def l4_lines(v: L4View, width: int) -> list[Text]:
    """`L4 up  breaker closed  hit 88%  mem 1.2G/4G  errors 0  shed 0  get 1.2ms put 3.4ms
    read .. write ..`: in that order, whole fields flowed into lines of `width` cells."""
    down = not v.up or v.breaker == "open"
    fields: list[Text] = [
        Text.assemble(("L4 ", "bold"), ("up", "green") if v.up else ("DOWN", "bold red")),
    ]
    if v.breaker is not None:
        style = "bold red" if v.breaker == "open" else "yellow" if v.breaker != "closed" else ""
        fields.append(Text.assemble("breaker ", (v.breaker, style)))
    fields.append(Text(f"hit {fmt.pct(v.hit_ratio)}"))
    if v.used is not None:
        if v.capacity:  # yellow, then red, as Redis nears maxmemory and starts evicting
            style = fmt.level(v.used / v.capacity)
            fields.append(
                Text.assemble("mem ", (f"{fmt.size(v.used)}/{fmt.size(v.capacity)}", style))
            )
        else:  # no maxmemory: Redis grows until the host runs out (kvtier doctor --l4-url)
            fields.append(Text.assemble("mem ", (f"{fmt.size(v.used)}/no limit", "yellow")))
    bad = bool(v.errors_rate) or (down and bool(v.errors))
    fields.append(Text.assemble("errors ", (fmt.count(v.errors), "bold red" if bad else "")))
    fields.append(Text.assemble("shed ", (fmt.count(v.shed), "yellow" if v.shed else "")))
    fields.append(Text(f"get {fmt.seconds(v.get_seconds)} put {fmt.seconds(v.put_seconds)}"))
    fields.append(Text(f"read {fmt.rate(v.read_rate)} write {fmt.rate(v.write_rate)}"))
    return fmt.flow(fields, width)
