"""The Host panel's lines: whole fields flowed into the panel's width, never cut.

Each row of the panel (memory, dirty pages, a zone, a GPU...) is a list of fields; a field that
does not fit on the current line starts the next one, so an 80x24 screen shows fewer fields per
line rather than `P…` or `o9…`.
"""

from __future__ import annotations

from rich.text import Text

from ops import thresholds as th
from ops.kvtop import fmt
from ops.kvtop.model import GpuView, Model, PlanView


def host_lines(model: Model, width: int, compact: bool = False) -> list[Text]:
    """The Host panel's lines for an inner `width`. Compact (the 80x24 layout) puts the GPU
    lines, which carry the allocator's cue, before page cache, disks and hugepages, and the GPU
    plan's bytes held against its budget right after the memory line (its parts with the GPU
    lines)."""
    h = model.host
    rows: list[list[Text]] = []
    if h.empty:
        rows.append([Text("no host metrics at this endpoint", style="dim")])
    mem: list[Text] = []
    if h.mem_available is not None:
        mem.append(
            Text("mem avail ")
            + Text(fmt.pct(h.mem_available), style=fmt.level(1 - h.mem_available, 0.8, 0.9))
        )
    for resource, some, full in h.psi:
        mem.append(
            Text(f"PSI {resource[:3] if compact else resource} ")
            + Text(f"{fmt.pct(some, 1)}/{fmt.pct(full, 1)}", style="red" if full else "")
        )
    rows.append(mem)
    plan = [] if model.plan is None else _plan_row(model.plan)  # kvtier serve on one GPU
    if plan and compact:  # the bytes held against the budget first, the parts with the GPUs
        rows.append(plan[:1])
        plan = [Text("GPU plan parts"), *plan[1:]]
    if h.dirty is not None:
        share = h.dirty / h.dirty_threshold if h.dirty_threshold else None
        d = Text(f"dirty+wb {fmt.size(h.dirty)}/{fmt.size(h.dirty_threshold)} ")
        d.append(fmt.pct(share), style=fmt.level(share, 0.5, 0.8))
        if not compact:
            d.append(f" of threshold (alert >{fmt.pct(th.DIRTY_PAGES.value)})", style="dim")
        rows.append([d])
    for z in h.zones:
        f = Text(f"n{z.node} {z.zone} " + ("" if compact else "free/order "))
        f.append(fmt.blocks(z.blocks), style="cyan")
        row = [
            f,
            Text("o9+ ") + Text(f"{z.headroom:.0f}", style="red" if z.headroom < 1 else "green"),
        ]
        if z.fragmentation is not None and not compact:
            # the kernel's index is -1 when a 2 MiB block is free: nothing to fragment
            frag = "none" if z.fragmentation < 0 else f"{z.fragmentation:.2f}"
            row.append(Text(f"frag {frag}"))
        rows.append(row)
        if not compact and width >= 96:
            rows.append([Text("  " + " ".join(fmt.count(b) for b in z.blocks), style="dim")])
    tail: list[list[Text]] = []
    if h.hugepages is not None:
        pool, free, rsvd, surplus = h.hugepages
        tail.append(
            [
                Text(f"hugepages {fmt.count(free)}/{fmt.count(pool)} free"),
                Text(f"{fmt.count(rsvd)} rsvd"),
                Text(f"{fmt.count(surplus)} surplus of {fmt.size(h.hugepage_size)}"),
            ]
        )
    if h.pagecache_hit is not None or h.pagecache_resident is not None:
        tail.append(
            [
                Text(f"L3 page cache hit {fmt.pct(h.pagecache_hit)}"),
                Text(f"resident {fmt.pct(h.pagecache_resident)}"),
            ]
        )
    if h.filesystem is not None:
        avail, size = h.filesystem
        tail.append([Text(f"L3 filesystem {fmt.size(avail)} free of {fmt.size(size)}")])
    for disk in h.disks:
        tail.append(
            [
                Text(f"{disk.device} r/s {fmt.per_s(disk.reads)} w/s {fmt.per_s(disk.writes)}"),
                Text(f"rB/s {fmt.size(disk.read_bytes)} wB/s {fmt.size(disk.written_bytes)}"),
                Text(f"await {fmt.seconds(disk.r_await)}/{fmt.seconds(disk.w_await)}"),
                Text(f"aqu {'-' if disk.queue is None else f'{disk.queue:.2f}'}"),
            ]
        )
    gpus = [row for g in h.gpus for row in _gpu_rows(g)]
    if plan:
        gpus.append(plan)
    rows += (gpus + tail) if compact else (tail + gpus)
    if not compact and not h.gpus and not h.empty:
        rows.append([Text("no GPU metrics (no NVIDIA driver, or --no-gpu)", style="dim")])
    return [line for row in rows if row for line in fmt.flow(row, width, _sep(row))]


class _Words(list):  # type: ignore[type-arg]
    """A row of words (prose): flowed with single spaces, where other rows use two."""


def _words(text: str, style: str) -> list[Text]:
    return _Words(Text(w, style=style) for w in text.split())


def _sep(row: list[Text]) -> str:
    return " " if isinstance(row, _Words) else "  "


def _gpu_rows(g: GpuView) -> list[list[Text]]:
    used_ratio = g.used / g.total if g.used is not None and g.total else None
    head = Text(f"GPU{g.gpu} ")
    head.append_text(fmt.bar(used_ratio, 10))
    head.append(f" {fmt.size(g.used)}/{fmt.size(g.total)}")
    row = [head, Text(f"util {fmt.pct(g.utilization)}")]
    row.append(Text(f"PCIe tx {fmt.rate(g.tx)} rx {fmt.rate(g.rx)}"))
    down = (g.width is not None and g.max_width is not None and g.width < g.max_width) or (
        g.gen is not None and g.max_gen is not None and g.gen < g.max_gen
    )
    link = f"gen{_n(g.gen)}x{_n(g.width)}/gen{_n(g.max_gen)}x{_n(g.max_width)}"
    row.append(Text(link, style="yellow" if down else "green"))
    if g.replays:
        row.append(Text(f"replays {fmt.count(g.replays)}", style="red"))
    if g.alloc_reserved is not None:
        row.append(_alloc(g))
    rows = [row]
    if g.shares_with_l3:
        rows.append(
            _words(
                f"! GPU{g.gpu} shares a PCIe {g.shares_with_l3} with the L3 drive: "
                "restores and L3 I/O compete for one uplink",
                "bold yellow",
            )
        )
    return rows


def _plan_row(p: PlanView) -> list[Text]:
    """The GPU memory plan: the bytes the process holds against its budget (red past
    KvtierGpuBudgetExceeded's threshold, yellow once they eat into the plan's headroom), then
    each part's planned bytes."""
    ratio = p.ratio
    if ratio is None:
        style = "dim"
    elif ratio > th.GPU_BUDGET.value:
        style = "red"
    elif p.used is not None and p.used > p.budget - (p.headroom or 0.0):
        style = "yellow"
    else:
        style = "green"
    head = Text("GPU plan ")
    head.append_text(fmt.bar(ratio, 10, style=None if style == "dim" else style))
    head.append(f" {fmt.size(p.used)}/{fmt.size(p.budget)} ")
    head.append(fmt.pct(ratio), style=f"bold {style}" if style == "red" else style)
    return [head, *(Text(f"{part} {fmt.size(n)}") for part, n in p.parts)]


def _alloc(g: GpuView) -> Text:
    """The CUDA caching allocator's cue: reserved bytes, the share stranded in split blocks (red
    past KvtierGpuAllocatorFragmented's threshold) and the cudaMalloc retries (red while they
    rise, yellow once any happened: KvtierGpuAllocatorRetries)."""
    t = th.GPU_ALLOC_FRAGMENTED
    text = Text(f"alloc {fmt.size(g.alloc_reserved)} split ")
    share = (
        g.alloc_split / g.alloc_reserved if g.alloc_split is not None and g.alloc_reserved else None
    )
    bad = share is not None and share > t.value and (g.alloc_split or 0) > t.floor
    text.append(
        fmt.pct(share), style="bold red" if bad else "green" if share is not None else "dim"
    )
    if g.alloc_retries is not None:
        text.append(" retries ")
        rising = bool(g.alloc_retry_rate)
        style = "bold red" if rising else "yellow" if g.alloc_retries else "green"
        text.append(fmt.count(g.alloc_retries) + ("↑" if rising else ""), style=style)
    return text


def _n(x: float | None) -> str:
    return "?" if x is None else f"{x:.0f}"
