"""The rendering layer: pure functions from a `Model` to rich renderables.

Nothing here fetches or computes figures; panel sizes are decided from the terminal size so
that 80x24 and 200x60 both lay out cleanly, and only the session rows that fit are drawn
(a 1,000-session list costs a sort, not 1,000 table rows).
"""

from __future__ import annotations

import dataclasses
import time

from rich.console import Group, RenderableType
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ops.kvtop import fmt
from ops.kvtop.host import host_lines
from ops.kvtop.l4 import l4_lines
from ops.kvtop.model import ACTIVE_FIRST, QUANTILES, Model, SessionsView, TierView
from ops.kvtop.trends import trend_lines

WIDE = 160  # columns from which panels sit side by side in two columns
TITLES = {1: "Tiers", 2: "Sessions", 3: "Restore", 4: "Host"}
SORT_HEADERS = {"bytes": "bytes", "tokens": "tokens", "last": "last", "l1": "L1/L2/L3"}
KEYS = (
    ("q", "quit"),
    ("p", "pause / resume refreshing"),
    ("s", "cycle the sessions sort: bytes, tokens, last activity, L1 chunks, tenant"),
    ("t", "filter sessions by tenant (empty: all)"),
    ("1-4", "focus Tiers, Sessions, Restore or Host (again, or 0: all panels)"),
    ("?", "this help (any key closes it)"),
)


def screen(model: Model, width: int, height: int, now: float | None = None) -> RenderableType:
    """The whole screen for a terminal of `width` x `height`."""
    now = time.time() if now is None else now
    top: list[RenderableType] = [header(model, now, width), alerts_line(model)]
    rows = 2
    if model.error:
        message = f"! {model.error}"
        lines = min(3, -(-len(message) // max(1, width)))
        top.append(Text(message, style="bold red", overflow="ellipsis"))
        rows += lines
    body_h = max(3, height - rows)
    layout = Layout()
    layout.split_column(Layout(Group(*top), size=rows), Layout(name="body"))
    layout["body"].update(_body(model, width, body_h, now))
    return layout


def _body(model: Model, width: int, height: int, now: float) -> RenderableType:
    if model.options.help:
        return help_panel()
    if model.scrapes == 0:
        msg = f"no data yet from {model.source}"
        if model.error:
            msg += "; --once gives up (exit 1)" if model.options.once else ": kvtop keeps retrying"
        return Panel(Text(msg, justify="center"), title="kvtop", border_style="red")
    focus = model.options.focus
    if focus:
        return _panel(model, focus, width, height, now)
    if width >= WIDE and height >= 30:
        return _wide(model, width, height, now)
    t_h = _tiers_height(model, width)
    low_h = 0
    if height >= 20:
        # The host row gets the lines it needs, leaving the sessions panel up to 8 rows (4
        # sessions), or what its list needs; the sessions panel takes whatever is left over.
        s = model.sessions
        listed = s.detail is None and s.pinned is not None
        # With an L4 the restore panel has an l4 row: two session rows make room for it.
        s_min = min(8 if model.l4 is None else 6, len(s.rows) + 4) if listed else 4
        host_h = len(host_lines(model, width - width // 2 - 4, compact=True)) + 2
        want = max(len(model.restore) + 3, host_h, 7)
        # every restore row shows (a source missing would be a cut field); the sessions
        # list, a top N that says so in its title, gives up rows for it
        low_h = max(7, len(model.restore) + 3, min(want, height - t_h - s_min))
    s_h = max(4, height - t_h - low_h)
    body = Layout()
    parts = [
        Layout(tiers_panel(model, width), size=t_h),
        Layout(sessions_panel(model, width, s_h, now), size=s_h),
    ]
    if low_h:
        low = Layout(size=low_h)
        low.split_row(
            Layout(restore_panel(model, width // 2, compact=True)),
            Layout(host_panel(model, width - width // 2, low_h, compact=True)),
        )
        parts.append(low)
    body.split_column(*parts)
    return body


def _tiers_height(model: Model, width: int) -> int:
    """The tiers panel's rows: the header and a row per tier (or the one-line note), the pool,
    L4 and counters lines as they flow into the panel's width, the borders."""
    lines = len(model.tiers) + 1 if model.tiers else 1
    return lines + len(_below_tiers(model, width - 4)) + 2


def _wide(model: Model, width: int, height: int, now: float) -> RenderableType:
    """Tiers across the whole width (its rows are wide: a bar and two sparklines per tier), then
    two columns: Sessions on the left, Restore over Host on the right. Each panel gets the rows
    its content needs; rows a column has left over chart its trends (the cache's traffic on
    the left, the serving figures on the right), and without trends the last panel of the
    column takes them."""
    left_w, right_w = width // 2, width - width // 2
    t_h = min(_tiers_height(model, width), height // 3)
    rest = height - t_h
    r_h = min(len(model.restore) + 4, rest // 2)
    s = model.sessions
    s_need = len(s.rows) + 4 if s.detail is None and s.pinned is not None else 4
    h_need = len(host_lines(model, right_w - 4)) + 2
    traffic = tuple(t for t in model.trends if t.unit == "B/s")
    serving = tuple(t for t in model.trends if t.unit != "B/s")
    left: list[Layout] = []
    right = [Layout(restore_panel(model, right_w), size=r_h)]
    for column, room, need, panel, charts, w in (
        (left, rest, s_need, lambda h: sessions_panel(model, left_w, h, now), traffic, left_w),
        (right, rest - r_h, h_need, lambda h: host_panel(model, right_w, h), serving, right_w),
    ):  # fmt: skip
        spare = room - need
        if charts and spare >= 5:
            column.append(Layout(panel(need), size=need))
            column.append(Layout(trends_panel(charts, w, spare)))
        else:
            column.append(Layout(panel(room)))
    columns = Layout(), Layout()
    columns[0].split_column(*left)
    columns[1].split_column(*right)
    below = Layout()
    below.split_row(*columns)
    body = Layout()
    body.split_column(Layout(tiers_panel(model, width), size=t_h), below)
    return body


def trends_panel(charts: tuple, width: int, height: int) -> Panel:  # type: ignore[type-arg]
    lines = trend_lines(charts, width - 4, height - 2)
    return Panel(Group(*lines), title="Trends (last 1m)", title_align="left", height=height)


def _panel(model: Model, n: int, width: int, height: int, now: float) -> RenderableType:
    if n == 1:
        return tiers_panel(model, width)
    if n == 2:
        return sessions_panel(model, width, height, now)
    if n == 3:
        return restore_panel(model, width)
    return host_panel(model, width, height)


def header(model: Model, now: float, width: int | None = None) -> Text:
    """The top line; in a narrow terminal the words `every` and `http://` go first, so the
    figures and the help hint stay whole."""
    for short in (False, True):
        t = _header(model, now, short)
        if width is None or t.cell_len <= width:
            break
    t.no_wrap, t.overflow = True, "ellipsis"
    return t


def _header(model: Model, now: float, short: bool) -> Text:
    o = model.options
    t = Text()
    t.append("kvtop ", style="bold")
    t.append(model.source.removeprefix("http://") if short else model.source, style="cyan")
    t.append(f"  {'' if short else 'every '}{model.interval:g}s")
    t.append(f"  sort {o.sort}")
    t.append(f"  tenant {o.tenant or 'all'}")
    if o.prompt is not None:
        t.append("  tenant filter (Enter applies, Esc cancels): ", style="bold")
        t.append(o.prompt + "_", style="reverse")
    if o.paused:
        t.append("  PAUSED", style="bold reverse yellow")
    t.append("  " + time.strftime("%H:%M:%S", time.localtime(now)))
    t.append("  ? help", style="dim")
    return t


def alerts_line(model: Model) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if not model.alerts:
        t.append("alerts: ", style="bold")
        t.append(
            "none would fire now" if model.scrapes else "not judged yet",
            style="green" if model.scrapes else "dim",
        )
        return t
    t.append(f"alerts ({len(model.alerts)}): ", style="bold red")
    for i, a in enumerate(model.alerts):
        if i:
            t.append("  ")
        t.append(
            a.alert.removeprefix("Kvtier"),
            style="bold red" if a.severity == "critical" else "yellow",
        )
        t.append(f" {a.detail}")
    return t


def _title(n: int, model: Model) -> str:
    mark = " (focused: 0 for all)" if model.options.focus == n else ""
    return f"[{n}] {TITLES[n]}{mark}"


def tier_label(name: str, paged: bool) -> str:
    """A tier row's name. The cache's own L1 tier is its "L1 buffers"; with paged L1 the
    sessions' L1 is the batch's page pool, "pool (L1)" (the names `kvtier plan` gives them)."""
    if name == "l1":
        return "pool (L1)" if paged else "L1 buffers"
    return name.upper()


def tiers_panel(model: Model, width: int) -> Panel:
    inner = width - 4
    paged = model.paged_l1
    labels = [tier_label(t.name, paged is not None) for t in model.tiers]
    # every column but the bar and the two sparklines at their widest, with the gaps: the
    # name, used/cap 11, chunks 6, hit 4, in and out 8 each beside their sparklines, queues 11
    fixed = max(map(len, labels), default=2) + 55
    spark_w = max(0, min(30, (inner - fixed) // 4))
    bar_w = max(6, min(30, inner - fixed - 2 * spark_w))
    table = Table.grid(padding=(0, 1))
    for col in ("tier", "bar", "used", "chunks", "hit", "in", "out", "q"):
        table.add_column(col, justify="left" if col in ("tier", "bar") else "right", no_wrap=True)
    table.add_row(
        *(
            Text(h, style="bold")
            for h in ("", "used", "used/cap", "chunks", "hit", "in", "out", "q w/r")
        )
    )
    for t, label in zip(model.tiers, labels, strict=True):
        if t.name == "l1" and paged is not None:  # the sessions' L1 is the page pool
            t = dataclasses.replace(
                t, used=paged.used, capacity=paged.capacity, chunks=paged.chunks
            )
        table.add_row(*_tier_row(t, label, bar_w, spark_w))
    parts: list[RenderableType] = [table]
    if not model.tiers:
        parts = [Text("no cache metrics at this endpoint (host signals only)", style="dim")]
    parts += _below_tiers(model, inner)
    return Panel(Group(*parts), title=_title(1, model), title_align="left")


def _below_tiers(model: Model, width: int) -> list[Text]:
    """The lines under the tier rows, each of whole fields flowed into `width`: the batch's page
    pool (kvtier serve), L4 (hidden without one), the cache-wide counters."""
    lines: list[Text] = []
    if model.pool:
        lines += fmt.flow(_pool_fields(model), width)
    if model.l4 is not None:
        lines += l4_lines(model.l4, width)
    if model.counters:
        fields = []
        for c in model.counters:
            bad = (bool(c.total) and c.name != "OOM retries") or bool(c.rate)
            field = Text(f"{c.name} ") + Text(
                fmt.count(c.total), style="bold red" if bad else "green"
            )
            if c.rate:
                field.append(f" (+{fmt.per_s(c.rate)}/s)", style="red")
            fields.append(field)
        lines += fmt.flow(fields, width)
    return lines


def _pool_fields(model: Model) -> list[Text]:
    """The batch's page pool by state. With paged L1 it is the sessions' L1 (the row above
    shows it), and the cache's own L1 buffers follow: its copy staging."""
    paged = model.paged_l1
    fields = [Text(f"{state} {fmt.size(nbytes)}") for state, nbytes in model.pool]
    if paged is None:
        return [Text("page pool ", style="bold") + fields[0], *fields[1:]]
    label = Text("pool (L1)", style="bold")
    if paged.sessions is not None:
        label.append(f", {paged.sessions} sessions")
    used, cap = paged.staging
    buffers = Text(f"L1 buffers {fmt.size(used)}/{fmt.size(cap)}", style="dim")
    return [label + Text(": ") + fields[0], *fields[1:], buffers]


def _tier_row(t: TierView, label: str, bar_w: int, spark_w: int) -> list[Text | str]:
    ratio = t.used / t.capacity if t.used is not None and t.capacity else None
    hit = fmt.pct(t.hit_ratio_recent if t.hit_ratio_recent is not None else t.hit_ratio)
    return [
        Text(label, style="bold"),
        fmt.bar(ratio, bar_w),
        f"{fmt.size(t.used)}/{fmt.size(t.capacity)}",
        fmt.count(t.chunks),
        hit,
        Text(fmt.spark(t.in_spark, spark_w), style="cyan") + Text(f" {fmt.rate(t.in_rate)}"),
        Text(fmt.spark(t.out_spark, spark_w), style="magenta") + Text(f" {fmt.rate(t.out_rate)}"),
        Text(_queues(t.queue, t.read_queue), style="yellow" if t.queue or t.read_queue else ""),
    ]


def _queues(write: float | None, read: float | None) -> str:
    if read is None:
        return fmt.count(write)
    return f"{fmt.count(write)}/{fmt.count(read)}"


def sessions_line(s: SessionsView) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    for i, (state, n) in enumerate(s.by_state):
        t.append(("  " if i else "") + f"{state} ")
        t.append(str(n), style="bold")
    if not any(state == "pinned" for state, _ in s.by_state):
        t.append("  pinned ")
        t.append("-" if s.pinned is None else str(s.pinned), style="bold")
    if s.running is not None:
        t.append(f"  running {s.running} queued {s.queued or 0}")
    return t


def sessions_panel(model: Model, width: int, height: int, now: float) -> Panel:
    s = model.sessions
    parts: list[RenderableType] = [sessions_line(s)]
    room = height - 4  # borders, the counts line, the table header
    if s.detail is not None or s.pinned is None:
        parts.append(Text(s.detail or "no per-session list from this source", style="dim"))
    else:
        rows = s.rows[: max(0, room)]
        parts.append(_sessions_table(model, rows, width - 4, now))
    title = _title(2, model)
    if s.pinned is not None:
        shown = min(len(s.rows), max(0, room))
        where = f" tenant {model.options.tenant}" if model.options.tenant else ""
        title += f" top {shown} of {s.total}{where} by {model.options.sort}"
        if model.options.sort in ACTIVE_FIRST:
            title += ", active first"
    return Panel(Group(*parts), title=title, title_align="left", height=height)


def _cut(text: str, width: int) -> str:
    """`text` in `width` characters; a longer one loses its middle (`lg-ca…-00017`): ids of one
    run share a prefix and differ at the end, so both ends are kept, the end a little longer."""
    if len(text) <= width:
        return text
    if width < 4:
        return text[:width]
    tail = width // 2
    return text[: width - 1 - tail] + "…" + text[len(text) - tail :]


def _sessions_table(model: Model, rows: tuple, width: int, now: float) -> Text:
    """Fixed-width lines rather than a rich Table: a table measures every cell of every row
    on every frame, which alone would spend the 30 ms frame budget at 200x60."""
    wide = width >= 100
    sort = model.options.sort
    id_w = max(8, min(36, width - (78 if wide else 64)))

    def head(name: str, key: str | None) -> str:
        if key == sort:
            return name + (" ▲" if key == "tenant" else " ▼")
        return name

    # (header, width, right-aligned)
    cols = [
        (head("session", None), id_w, False),
        (head("tenant", "tenant"), 12, False),
        ("state", 11, False),
        (head("tokens", "tokens"), 8, True),
        (head("bytes", "bytes"), 9, True),
        (head("L1/L2/L3", "l1"), 12, True),
    ]
    if wide:
        cols.append(("split", 12, False))
    cols.append((head("last", "last"), 6, True))
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(
        " ".join(h.rjust(w) if right else h.ljust(w) for h, w, right in cols).rstrip(),
        style="bold",
    )
    styles = {"active": "bold green", "hibernated": "blue"}
    for r in rows:
        out.append("\n")
        out.append(_cut(r.session_id, id_w).ljust(id_w) + " " + _cut(r.tenant, 12).ljust(12) + " ")
        out.append((r.state + ("*" if r.pinned else "")).ljust(11), style=styles.get(r.state))
        out.append(
            f" {fmt.count(r.tokens):>8} {fmt.size(r.bytes):>9} "
            f"{f'{r.chunks_l1}/{r.chunks_l2}/{r.chunks_l3}':>12} "
        )
        if wide:
            out.append_text(_split(r.chunks_l1, r.chunks_l2, r.chunks_l3, 12))
            out.append(" ")
        out.append(f"{fmt.age(now - r.last_active):>6}")
    return out


def _split(l1: int, l2: int, l3: int, width: int) -> Text:
    """Where a session's chunks are: green L1, yellow L2, blue L3, as shares of `width` cells."""
    total = l1 + l2 + l3
    if total <= 0:
        return Text("·" * width, style="dim")
    t = Text()
    used = 0
    for n, style, ch in ((l1, "green", "1"), (l2, "yellow", "2"), (l3, "blue", "3")):
        cells = round(n / total * width)
        cells = min(cells, width - used)
        t.append(ch * cells, style=f"reverse {style}")
        used += cells
    t.append(" " * (width - used))
    return t


def restore_panel(model: Model, width: int, compact: bool = False) -> Panel:
    metric = model.restore_metric
    # compact, one space between columns: at 80 columns the panel has 36 cells inside, and its
    # widest row (`recompute 12.3k  100% 12.3ms 12.3ms`) needs 35
    pad = (0, 0, 0, 1) if compact else (0, 1)
    table = Table(box=None, padding=pad, pad_edge=False, show_edge=False, header_style="bold")
    table.add_column("src", no_wrap=True)
    table.add_column("n" if compact else "restores", justify="right", no_wrap=True)
    if not compact:
        table.add_column("/s", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    if not compact:
        table.add_column("tokens", justify="right", no_wrap=True)
    shown = (0, 2) if compact else tuple(range(len(QUANTILES)))
    for i in shown:
        table.add_column(f"p{QUANTILES[i] * 100:g}", justify="right", no_wrap=True)
    if not compact:
        table.add_column("n", justify="right", no_wrap=True)
    for r in model.restore:
        cells: list[Text | str] = [
            Text(r.src, style="bold yellow" if r.src == "recompute" else "bold"),
            # compact: `n` is what the percentiles come from (as the full panel's last column),
            # dim where that is since start rather than the last minute
            Text(fmt.count(r.observed), style="" if r.recent else "dim")
            if compact
            else fmt.count(r.decisions),
        ]
        if not compact:
            cells.append(fmt.per_s(r.rate))
        cells.append(fmt.pct(r.share))
        if not compact:
            cells.append(fmt.count(r.tokens))
        cells += [fmt.seconds(r.quantiles[i]) for i in shown]
        if not compact:
            cells.append(f"{fmt.count(r.observed)}{'' if r.recent else ' all'}")
        table.add_row(*cells)
    what = "TTFT" if metric == "TTFT" else "restore time"
    title = f"{_title(3, model)} ({what})"
    if not compact:  # the longest that fits beside the borders
        for more in (
            " decisions and percentiles (last 1m, else since start)",
            " percentiles: last 1m, else since start",
        ):
            if len(title + more) <= width - 6:
                title += more
                break
    return Panel(table, title=title, title_align="left")


def host_panel(model: Model, width: int, height: int, compact: bool = False) -> Panel:
    """The host signals as whole fields flowed into the panel's width: a field that does not fit
    on a line starts the next one, never cut; lines beyond the height are counted, not cut."""
    lines = host_lines(model, width - 4, compact)
    room = max(1, height - 2)
    if len(lines) > room:
        hidden = len(lines) - room + 1
        hint = "a taller terminal shows them" if model.options.focus == 4 else "4 shows all"
        lines = [*lines[: room - 1], Text(f"+{hidden} more lines: {hint}", style="dim")]
    for t in lines:
        t.no_wrap, t.overflow = True, "ellipsis"
    return Panel(Group(*lines), title=_title(4, model), title_align="left", height=height)


def help_panel() -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, what in KEYS:
        table.add_row(key, what)
    notes = Text(
        "\nAlerts: an alert is listed when its condition holds now, judged with the thresholds "
        "of the alert rules (ops/thresholds.py); Prometheus also waits its `for` time.\n"
        "Rates cover the last refresh; hit ratios and percentiles the last minute.",
        style="dim",
    )
    return Panel(Group(table, notes), title="kvtop keys", title_align="left")
