"""The figures kvtop shows, computed from the scrape history and the session list.

Pure: `build()` turns a `History`, an optional session list and the view options into a frozen
`Model` that the rendering layer draws without computing anything itself. Absent sources (no
GPU, no PSI, an endpoint without a session list) give None or empty lists, never a made-up 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.snapshot import SessionInfo
from ops.kvtop import metrics as m
from ops.kvtop.alerts import Firing, judge
from ops.kvtop.history import History
from ops.kvtop.l4 import L4View, l4_view
from ops.kvtop.metrics import Scrape
from ops.kvtop.pool import PagedL1, paged_l1, pool
from ops.kvtop.trends import Trend, trends

TIERS = ("l1", "l2", "l3")  # L4 (Redis) has a line of its own (ops.kvtop.l4)
STATES = ("active", "idle", "hibernated")
SOURCES = ("l1", "l2", "l3", "l4", "recompute")  # l4 only where there are l4 restores
SORTS = ("bytes", "tokens", "last", "l1", "tenant")  # the `s` key cycles through these
QUANTILES = (0.5, 0.9, 0.99)
HUGE_ORDER = 9  # 2 MiB blocks with 4 KiB pages: what THP, hugetlb and large pinned buffers need
# The GPU memory plan's parts in plan order (kvtier.server.devices.memplan.PARTS): kvtop shows them so
# whatever order the exposition has; a part it does not know follows them.
PLAN_PARTS = (
    "context", "weights", "activations", "graphs", "staging", "l1", "inflight", "pool", "headroom",
)  # fmt: skip


@dataclass(frozen=True)
class SessionList:
    """What a session endpoint returned (or the L3 index held), and how many requests run."""

    sessions: tuple[SessionInfo, ...]
    running: int | None = None
    queued: int | None = None


def parse_sessions(text: str) -> SessionList:
    """The JSON of `GET /v1/sessions` (kvtier serve's admin endpoint) -> SessionList."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError("expected an object with a 'data' list of sessions")
    rows = []
    for d in doc["data"]:
        rows.append(
            SessionInfo(
                session_id=str(d["session_id"]),
                tenant=str(d.get("tenant", "")),
                state=str(d.get("state", "")),
                pinned=bool(d.get("pinned", False)),
                tokens=int(d.get("tokens", 0)),
                bytes=int(d.get("bytes", 0)),
                chunks_l1=int(d.get("chunks_l1", 0)),
                chunks_l2=int(d.get("chunks_l2", 0)),
                chunks_l3=int(d.get("chunks_l3", 0)),
                last_active=float(d.get("last_active", 0.0)),
            )
        )
    running, queued = doc.get("running"), doc.get("queued")
    return SessionList(
        tuple(rows),
        int(running) if isinstance(running, int) else None,
        int(queued) if isinstance(queued, int) else None,
    )


@dataclass(frozen=True)
class Options:
    """What the keys change: sort column, tenant filter, paused, focused panel, help."""

    sort: str = "bytes"
    tenant: str | None = None
    paused: bool = False
    focus: int | None = None  # 1 tiers, 2 sessions, 3 restore, 4 host
    help: bool = False
    prompt: str | None = None  # the tenant being typed after `t`, shown in the header
    once: bool = False  # `kvtop --once`: one frame, no retrying


@dataclass(frozen=True)
class TierView:
    name: str
    capacity: float | None
    used: float | None
    chunks: float | None
    hit_ratio: float | None  # since the cache started
    hit_ratio_recent: float | None  # over the last minute, when it had lookups
    in_rate: float | None  # bytes/s into the tier (transfers with dst = tier)
    out_rate: float | None  # bytes/s out of it
    in_spark: tuple[float, ...] = ()
    out_spark: tuple[float, ...] = ()
    queue: float | None = None  # jobs waiting in the tier's write queue
    read_queue: float | None = None  # and in its read queue, where it has one
    evictions_rate: float | None = None


@dataclass(frozen=True)
class Counter:
    """A cache-wide counter: its total and its rate over the last interval."""

    name: str
    total: float | None
    rate: float | None


@dataclass(frozen=True)
class SessionsView:
    by_state: tuple[tuple[str, int], ...]
    pinned: int | None  # None without a session list
    total: int  # sessions in the list after the tenant filter
    rows: tuple[SessionInfo, ...]  # sorted, filtered; every row (the renderer cuts)
    detail: str | None  # why there is no per-session list, if there is none
    running: int | None = None
    queued: int | None = None


@dataclass(frozen=True)
class RestoreRow:
    src: str
    decisions: float | None
    rate: float | None
    share: float | None
    tokens: float | None
    quantiles: tuple[float | None, ...]  # QUANTILES, seconds
    observed: float  # observations the quantiles come from
    recent: bool  # quantiles over the last minute (else since start)


@dataclass(frozen=True)
class ZoneView:
    node: str
    zone: str
    blocks: tuple[float, ...]  # free blocks per order
    headroom: float  # free order-9 blocks, higher orders counted as their 2**(o-9) halves
    fragmentation: float | None


@dataclass(frozen=True)
class DiskView:
    device: str
    reads: float | None  # r/s
    writes: float | None  # w/s
    read_bytes: float | None  # bytes/s
    written_bytes: float | None
    r_await: float | None  # seconds
    w_await: float | None
    queue: float | None  # aqu-sz
    in_flight: float | None


@dataclass(frozen=True)
class GpuView:
    gpu: str
    used: float | None
    total: float | None
    utilization: float | None
    tx: float | None
    rx: float | None
    gen: float | None
    max_gen: float | None
    width: float | None
    max_width: float | None
    replays: float | None
    shares_with_l3: str | None  # "switch" / "root port" when the GPU shares an uplink with L3
    # The CUDA caching allocator of the serving process (`kvtier serve` only; None elsewhere):
    alloc_reserved: float | None = None  # bytes reserved from CUDA
    alloc_split: float | None = None  # free bytes stranded in split blocks
    alloc_retries: float | None = None  # cudaMalloc retries after a cache flush, since start
    alloc_retry_rate: float | None = None  # retries per second over the last refresh


@dataclass(frozen=True)
class PlanView:
    """`kvtier serve`'s GPU memory plan: the budget, the bytes held now, each part's bytes."""

    budget: float
    used: float | None
    parts: tuple[tuple[str, float], ...]  # PLAN_PARTS order

    @property
    def ratio(self) -> float | None:
        """Used over budget; None without both."""
        return self.used / self.budget if self.used is not None and self.budget > 0 else None

    @property
    def headroom(self) -> float | None:
        return dict(self.parts).get("headroom")


@dataclass(frozen=True)
class HostView:
    zones: tuple[ZoneView, ...] = ()
    hugepages: tuple[float | None, float | None, float | None, float | None] | None = None
    hugepage_size: float | None = None
    psi: tuple[tuple[str, float | None, float | None], ...] = ()  # resource, some, full (0..1)
    mem_available: float | None = None  # ratio of RAM outside the hugetlb pool
    dirty: float | None = None  # dirty + writeback bytes
    dirty_threshold: float | None = None
    pagecache_hit: float | None = None
    pagecache_resident: float | None = None
    disks: tuple[DiskView, ...] = ()
    gpus: tuple[GpuView, ...] = ()
    filesystem: tuple[float, float] | None = None  # avail, size

    @property
    def empty(self) -> bool:
        return not (self.zones or self.psi or self.disks or self.gpus or self.dirty is not None)


@dataclass(frozen=True)
class Model:
    tiers: tuple[TierView, ...]
    counters: tuple[Counter, ...]
    sessions: SessionsView
    restore: tuple[RestoreRow, ...]
    restore_metric: str  # "TTFT" (server histogram) or "restore" (cache histogram)
    host: HostView
    alerts: tuple[Firing, ...]
    options: Options
    source: str
    interval: float
    error: str | None = None  # the last fetch failed: why, and that kvtop keeps retrying
    scrapes: int = 0
    has_cache: bool = True
    notes: tuple[str, ...] = field(default=())
    l4: L4View | None = None  # the shared tier (Redis); None when the endpoint has none
    # the batch's page pool in bytes by state (parked, running, free), from `kvtier serve`'s
    # own gauges; empty elsewhere. With paged L1 its parked pages are the sessions' L1
    pool: tuple[tuple[str, float], ...] = ()
    # with paged L1 the pool is the sessions' L1, shown on the L1 row (ops.kvtop.pool); None
    # where L1 is the cache's own buffers, or there is no pool
    paged_l1: PagedL1 | None = None
    # the GPU memory plan of `kvtier serve` on one GPU; None elsewhere (the CPU, a model across
    # devices, the exporter): then the Host panel has no plan row
    plan: PlanView | None = None
    # figures over the last minute, charted where a tall terminal has rows to spare
    trends: tuple[Trend, ...] = ()


def build(
    history: History,
    sessions: SessionList | None,
    options: Options,
    *,
    source: str,
    interval: float,
    error: str | None = None,
    detail: str | None = None,
) -> Model:
    """Everything the screen shows, from the history's latest scrapes and the session list."""
    cur = history.latest
    if cur is None:
        empty = SessionsView((), None, 0, (), detail)
        return Model(
            (), (), empty, (), "TTFT", HostView(), (), options, source, interval, error, 0, False
        )
    prev = history.previous
    minute = history.baseline(history.window_s)
    return Model(
        tiers=tuple(_tier(history, cur, prev, minute, t) for t in TIERS if _has_tier(cur, t)),
        counters=tuple(
            Counter(label, cur.get(name), m.rate(prev, cur, name))
            for label, name in (
                ("shed writes", "kvtier_shed_writes_total"),
                ("checksum failures", "kvtier_checksum_failures_total"),
                ("I/O errors", "kvtier_io_errors_total"),
                ("OOM retries", "kvtier_oom_retries_total"),
                ("degraded turns", "kvtier_server_degraded_turns_total"),
            )
            if cur.has(name)
        )
        + _device_rows(cur),
        sessions=_sessions(cur, sessions, options, detail),
        restore=_restore(cur, prev, minute),
        restore_metric="TTFT" if cur.has("kvtier_server_ttft_seconds_bucket") else "restore",
        host=_host(cur, prev),
        alerts=tuple(judge(history)),
        options=options,
        source=source,
        interval=interval,
        error=error,
        scrapes=len(history),
        has_cache=cur.has("kvtier_tier_used_bytes"),
        l4=l4_view(cur, prev, minute),
        pool=pool(cur),
        paged_l1=paged_l1(cur, None if sessions is None else sessions.sessions),
        plan=gpu_plan(cur),
        trends=trends(history),
    )


def gpu_plan(cur: Scrape) -> PlanView | None:
    """The GPU memory plan, when the endpoint exports one (its budget)."""
    budget = cur.get("kvtier_gpu_memory_budget_bytes")
    if budget is None:
        return None
    found = {d.get("part", ""): v for d, v in cur.series("kvtier_gpu_memory_bytes")}
    order = [p for p in PLAN_PARTS if p in found] + [p for p in found if p not in PLAN_PARTS]
    return PlanView(
        budget,
        cur.get("kvtier_gpu_memory_process_bytes"),
        tuple((p, found[p]) for p in order),
    )


def _device_rows(cur: Scrape) -> tuple[Counter, ...]:
    """Lost devices of a model placed across devices (no rate: a count of devices)."""
    lost = cur.get("kvtier_server_devices", state="lost")
    return () if lost is None else (Counter("lost devices", lost, None),)


def _has_tier(cur: Scrape, tier: str) -> bool:
    return cur.get("kvtier_tier_capacity_bytes", tier=tier) is not None


def _ratio(hits: float | None, misses: float | None) -> float | None:
    if hits is None or misses is None or hits + misses <= 0:
        return None
    return hits / (hits + misses)


def _tier(
    history: History, cur: Scrape, prev: Scrape | None, minute: Scrape | None, tier: str
) -> TierView:
    hits, misses = (
        cur.get("kvtier_tier_hits_total", tier=tier),
        cur.get("kvtier_tier_misses_total", tier=tier),
    )
    recent = None
    if minute is not None:
        h = m.increase(minute, cur, "kvtier_tier_hits_total", (("tier", tier),))
        x = m.increase(minute, cur, "kvtier_tier_misses_total", (("tier", tier),))
        if h is not None and x is not None:
            recent = _ratio(h[0], x[0])

    def into(a: Scrape, b: Scrape) -> float | None:
        return m.rate_sum(a, b, "kvtier_transfer_bytes_total", dst=tier)

    def out_of(a: Scrape, b: Scrape) -> float | None:
        return m.rate_sum(a, b, "kvtier_transfer_bytes_total", src=tier)

    queue = cur.total("kvtier_queue_depth", queue=f"{tier}_write")
    return TierView(
        name=tier,
        capacity=cur.get("kvtier_tier_capacity_bytes", tier=tier),
        used=cur.get("kvtier_tier_used_bytes", tier=tier),
        chunks=cur.get("kvtier_tier_chunks", tier=tier),
        hit_ratio=_ratio(hits, misses),
        hit_ratio_recent=recent,
        in_rate=None if prev is None else into(prev, cur),
        out_rate=None if prev is None else out_of(prev, cur),
        in_spark=tuple(history.spark(into)),
        out_spark=tuple(history.spark(out_of)),
        queue=queue,
        read_queue=cur.total("kvtier_queue_depth", queue=f"{tier}_read"),
        evictions_rate=m.rate(prev, cur, "kvtier_tier_evictions_total", tier=tier),
    )


# Sorts that list active sessions first, then idle, then hibernated: by bytes alone a small
# screen fills with large sessions hibernated long ago. By last activity the active come first
# anyway; by tenant the list is alphabetical.
ACTIVE_FIRST = ("bytes", "tokens", "l1")
RANK = {"active": 2, "idle": 1}  # descending: active, idle, then hibernated and any other


def sort_key(name: str):  # type: ignore[no-untyped-def]
    """(key function, descending) for a sort column of the sessions table."""
    keys = {
        "bytes": (lambda s: (RANK.get(s.state, 0), s.bytes, s.tokens), True),
        "tokens": (lambda s: (RANK.get(s.state, 0), s.tokens, s.bytes), True),
        "last": (lambda s: s.last_active, True),
        "l1": (lambda s: (RANK.get(s.state, 0), s.chunks_l1, s.bytes), True),
        "tenant": (lambda s: (s.tenant, s.session_id), False),
    }
    return keys[name]


def _sessions(
    cur: Scrape, sessions: SessionList | None, options: Options, detail: str | None
) -> SessionsView:
    by_state = [(s, int(cur.get("kvtier_sessions", state=s) or 0)) for s in STATES]
    by_state += [
        (d["state"], int(v)) for d, v in cur.series("kvtier_sessions") if d["state"] not in STATES
    ]
    if sessions is None:
        return SessionsView(tuple(by_state), None, 0, (), detail)
    rows: Sequence[SessionInfo] = sessions.sessions
    if options.tenant:
        rows = [s for s in rows if s.tenant == options.tenant]
    key, descending = sort_key(options.sort)
    ordered = sorted(rows, key=key, reverse=descending)
    pinned = dict(by_state).get("pinned")
    return SessionsView(
        tuple(by_state),
        sum(1 for s in rows if s.pinned) if pinned is None else pinned,
        len(ordered),
        tuple(ordered),
        None,
        sessions.running,
        sessions.queued,
    )


def _restore(cur: Scrape, prev: Scrape | None, minute: Scrape | None) -> tuple[RestoreRow, ...]:
    hist = (
        "kvtier_server_ttft_seconds"
        if cur.has("kvtier_server_ttft_seconds_bucket")
        else "kvtier_restore_duration_seconds"
    )
    decisions = {d["src"]: v for d, v in cur.series("kvtier_restore_decisions_total")}
    more = [*decisions, *cur.label_values(f"{hist}_bucket", "src")]
    srcs = [s for s in SOURCES if s != "l4" or s in more]
    srcs += [s for s in dict.fromkeys(more) if s not in srcs]
    total = sum(decisions.values())
    rows = []
    for src in srcs:
        now = m.buckets(cur, hist, src=src)
        window = None
        if minute is not None and now:
            window = m.bucket_delta(m.buckets(minute, hist, src=src), now)
            if window is not None and window[-1][1] <= 0:
                window = None
        used = window or now
        rows.append(
            RestoreRow(
                src=src,
                decisions=decisions.get(src),
                rate=m.rate(prev, cur, "kvtier_restore_decisions_total", src=src),
                share=decisions[src] / total if src in decisions and total > 0 else None,
                tokens=cur.get("kvtier_restored_tokens_total", src=src),
                quantiles=tuple(m.quantile(q, used) for q in QUANTILES),
                observed=used[-1][1] if used else 0.0,
                recent=window is not None,
            )
        )
    return tuple(rows)


def headroom(blocks: Sequence[float], order: int = HUGE_ORDER) -> float:
    """Free blocks of `order`, each higher-order block counted as the 2**(o-order) it splits into."""
    return sum(n * (1 << (o - order)) for o, n in enumerate(blocks) if o >= order)


def _zones(cur: Scrape) -> tuple[ZoneView, ...]:
    grouped: dict[tuple[str, str], dict[int, float]] = {}
    for d, v in cur.series("kvtier_buddyinfo_blocks"):
        grouped.setdefault((d["node"], d["zone"]), {})[int(d["order"])] = v
    out = []
    for (node, zone), orders in grouped.items():
        blocks = tuple(orders.get(o, 0.0) for o in range(max(orders) + 1))
        out.append(
            ZoneView(
                node,
                zone,
                blocks,
                headroom(blocks),
                cur.get("kvtier_buddyinfo_fragmentation_index", node=node, zone=zone),
            )
        )
    normal = [z for z in out if z.zone in ("Normal", "Movable")]
    return tuple(normal or out)


def _disks(cur: Scrape, prev: Scrape | None) -> tuple[DiskView, ...]:
    out = []
    for device in cur.label_values("kvtier_disk_reads_completed_total", "device"):

        def r(name: str, device: str = device) -> float | None:
            return m.rate(prev, cur, f"kvtier_disk_{name}_total", device=device)

        reads, writes = r("reads_completed"), r("writes_completed")
        rt, wt = r("read_time_seconds"), r("write_time_seconds")
        out.append(
            DiskView(
                device=device,
                reads=reads,
                writes=writes,
                read_bytes=r("read_bytes"),
                written_bytes=r("written_bytes"),
                r_await=rt / reads if rt is not None and reads else None,
                w_await=wt / writes if wt is not None and writes else None,
                queue=r("io_time_weighted_seconds"),
                in_flight=cur.get("kvtier_disk_io_now", device=device),
            )
        )
    return tuple(out)


PROXIMITY = {2: "root port", 3: "switch"}


def _gpus(cur: Scrape, prev: Scrape | None) -> tuple[GpuView, ...]:
    out = []
    gpus = cur.label_values("kvtier_gpu_memory_total_bytes", "gpu")
    gpus += [g for g in cur.label_values("kvtier_torch_reserved_bytes", "gpu") if g not in gpus]
    for gpu in gpus:

        def g(name: str, gpu: str = gpu) -> float | None:
            return cur.get(f"kvtier_gpu_{name}", gpu=gpu)

        near = [v for _, v in cur.series("kvtier_gpu_l3_pcie_proximity", gpu=gpu)]
        level = int(max(near)) if near else 0
        out.append(
            GpuView(
                gpu=gpu,
                used=g("memory_used_bytes"),
                total=g("memory_total_bytes"),
                utilization=g("utilization_ratio"),
                tx=g("pcie_tx_bytes_per_second"),
                rx=g("pcie_rx_bytes_per_second"),
                gen=g("pcie_link_generation"),
                max_gen=g("pcie_link_max_generation"),
                width=g("pcie_link_width"),
                max_width=g("pcie_link_max_width"),
                replays=g("pcie_replay_total"),
                shares_with_l3=PROXIMITY.get(level),
                alloc_reserved=cur.get("kvtier_torch_reserved_bytes", gpu=gpu),
                alloc_split=cur.get("kvtier_torch_inactive_split_bytes", gpu=gpu),
                alloc_retries=cur.get("kvtier_torch_alloc_retries_total", gpu=gpu),
                alloc_retry_rate=m.rate(prev, cur, "kvtier_torch_alloc_retries_total", gpu=gpu),
            )
        )
    return tuple(out)


def _host(cur: Scrape, prev: Scrape | None) -> HostView:
    psi = []
    for resource in ("memory", "io"):
        some = m.rate(prev, cur, f"kvtier_pressure_{resource}_waiting_seconds_total")
        full = m.rate(prev, cur, f"kvtier_pressure_{resource}_stalled_seconds_total")
        if cur.has(f"kvtier_pressure_{resource}_waiting_seconds_total"):
            psi.append((resource, some, full))
    total, avail = cur.get("kvtier_memory_total_bytes"), cur.get("kvtier_memory_available_bytes")
    hugetlb = cur.get("kvtier_memory_hugetlb_bytes") or 0.0
    dirty, wb = cur.get("kvtier_memory_dirty_bytes"), cur.get("kvtier_memory_writeback_bytes")
    fs_avail, fs_size = (
        cur.get("kvtier_l3_filesystem_avail_bytes"),
        cur.get("kvtier_l3_filesystem_size_bytes"),
    )
    pool = cur.get("kvtier_hugepages_pool")
    return HostView(
        zones=_zones(cur),
        hugepages=None
        if pool is None
        else (
            pool,
            cur.get("kvtier_hugepages_free"),
            cur.get("kvtier_hugepages_reserved"),
            cur.get("kvtier_hugepages_surplus"),
        ),
        hugepage_size=cur.get("kvtier_hugepage_size_bytes"),
        psi=tuple(psi),
        mem_available=avail / (total - hugetlb)
        if total is not None and avail is not None and total - hugetlb > 0
        else None,
        dirty=None if dirty is None else dirty + (wb or 0.0),
        dirty_threshold=cur.get("kvtier_memory_dirty_threshold_bytes"),
        pagecache_hit=cur.get("kvtier_l3_pagecache_hit_ratio"),
        pagecache_resident=cur.get("kvtier_l3_pagecache_resident_ratio"),
        disks=_disks(cur, prev),
        gpus=_gpus(cur, prev),
        filesystem=None if fs_avail is None or fs_size is None else (fs_avail, fs_size),
    )
