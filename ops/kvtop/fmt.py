"""Number formats, bars and sparklines for kvtop's screen (pure string functions)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

SPARKS = "▁▂▃▄▅▆▇█"


def size(x: float | None) -> str:
    """Bytes in binary units (K = 1024) with three significant digits: 1023, 1.50K, 352K, 12.3M."""
    if x is None:
        return "-"
    n = float(x)
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            if unit == "":
                return f"{n:.0f}"
            digits = 0 if abs(n) >= 100 else 1 if abs(n) >= 10 else 2
            return f"{n:.{digits}f}{unit}"
        n /= 1024
    return f"{n:.0f}P"  # pragma: no cover - the loop returns


def rate(x: float | None) -> str:
    """Bytes per second."""
    return "-" if x is None else f"{size(x)}/s"


def count(x: float | None) -> str:
    """A count: exact below 10,000, then 12.3k, 4.5M."""
    if x is None:
        return "-"
    if abs(x) < 10_000:
        return f"{x:.0f}"
    for unit, div in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if abs(x) < div * 1000 or unit == "G":
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"  # pragma: no cover


def pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def per_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 100 else count(x)


def seconds(x: float | None) -> str:
    """Latency: 850us, 12.3ms, 1.25s."""
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f}us"
    if x < 1:
        return f"{x * 1e3:.3g}ms"
    return f"{x:.3g}s"


def age(x: float) -> str:
    """Seconds ago as 5s, 3m, 2h, 4d."""
    x = max(0.0, x)
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if x >= div:
            return f"{x // div:.0f}{unit}"
    return f"{x:.0f}s"


def level(ratio: float | None, warn: float = 0.8, crit: float = 0.95) -> str:
    """Style for a fill ratio: green, then yellow at `warn`, red at `crit`."""
    if ratio is None:
        return "dim"
    return "red" if ratio >= crit else "yellow" if ratio >= warn else "green"


def bar(ratio: float | None, width: int, style: str | None = None) -> Text:
    """A fill bar `████░░░░` of `width` cells (1/8-cell resolution at the edge)."""
    if width <= 0:
        return Text("")
    if ratio is None:
        return Text("·" * width, style="dim")
    ratio = min(max(ratio, 0.0), 1.0)
    eighths = round(ratio * width * 8)
    full, part = divmod(eighths, 8)
    cells = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part and full < width else "")
    filled = cells.rstrip(" ")
    text = Text(filled, style=style or level(ratio))
    text.append("░" * (width - len(filled)), style="dim")
    return text


def spark(values: Sequence[float], width: int) -> str:
    """The last `width` values as block characters scaled to their maximum (0 -> space)."""
    if width <= 0:
        return ""
    tail = list(values)[-width:]
    top = max(tail, default=0.0)
    out = []
    for v in tail:
        if v <= 0 or top <= 0:
            out.append(" ")
        else:
            out.append(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))])
    return "".join(out).rjust(width)


def flow(fields: Sequence[Text], width: int, sep: str = "  ") -> list[Text]:
    """`fields` joined by `sep` into lines of at most `width` cells, a field never split (one
    wider than `width` alone on its line, cut there as the last resort)."""
    out: list[Text] = []
    line = Text()
    for f in fields:
        if line.cell_len and line.cell_len + len(sep) + f.cell_len > width:
            out.append(line)
            line = Text()
        if line.cell_len:
            line.append(sep)
        line.append_text(f)
    if line.cell_len:
        out.append(line)
    return out


def blocks(counts: Sequence[float]) -> str:
    """Free blocks per order as one character each, on a log scale (empty order -> '·')."""
    import math

    logs = [math.log10(c + 1) for c in counts]
    top = max(logs, default=0.0)
    out = []
    for c, lg in zip(counts, logs, strict=True):
        if c <= 0 or top <= 0:
            out.append("·")
        else:
            out.append(SPARKS[min(len(SPARKS) - 1, int(lg / top * (len(SPARKS) - 1) + 0.5))])
    return "".join(out)
