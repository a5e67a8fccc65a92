"""The alerts that would fire now, judged from kvtop's scrapes with `ops.thresholds`.

Each check mirrors the expression in `ops.exporter.rules.EXPRESSIONS` with the same Threshold,
so kvtop and Prometheus never disagree on a number. Two differences, both stated on screen:
kvtop judges the condition now (Prometheus also waits `for`), and its look-back is the time it
has watched, up to the rule's window (a rate needs two scrapes; nothing is guessed before).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ops import thresholds as th
from ops.kvtop import fmt
from ops.kvtop import metrics as m
from ops.kvtop.history import History
from ops.kvtop.metrics import Scrape


@dataclass(frozen=True)
class Firing:
    """One alert whose condition holds now."""

    alert: str
    severity: str
    detail: str  # the measured figure against the threshold, e.g. "gpu 0 free 3% < 5%"
    for_s: int  # how long Prometheus waits before it fires


def _fire(t: th.Threshold, detail: str) -> Firing:
    return Firing(t.alert, t.severity, detail, t.for_s)


def _window_rate(history: History, t: th.Threshold, name: str, **labels: str) -> float | None:
    cur = history.latest
    assert cur is not None
    return m.rate(history.baseline(t.window_s), cur, name, **labels)


def _window_increase(history: History, t: th.Threshold, name: str) -> float | None:
    cur = history.latest
    assert cur is not None
    inc = m.increase(history.baseline(t.window_s), cur, name)
    return None if inc is None else inc[0]


def predict_linear(history: History, t: th.Threshold, name: str) -> float | None:
    """PromQL's predict_linear(name[window], horizon): least squares over the kept scrapes,
    evaluated `horizon_s` after the latest one; None with fewer than two points."""
    pts = [(s.taken_at, s.get(name)) for s in history.points(t.window_s)]
    xy = [(x, y) for x, y in pts if y is not None]
    if len(xy) < 2:
        return None
    n = len(xy)
    mx = sum(x for x, _ in xy) / n
    my = sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in xy) / sxx
    now = xy[-1][0]
    return my + slope * (now - mx) + slope * t.horizon_s


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.2f}%"


def judge(history: History) -> Iterator[Firing]:
    """Every alert of ops.thresholds whose condition holds in the latest scrape."""
    cur = history.latest
    if cur is None:
        return
    yield from _memory(history, cur)
    yield from _cache(history, cur)
    yield from _devices(history, cur)


def _memory(history: History, cur: Scrape) -> Iterator[Firing]:
    t = th.MEMORY_PSI_FULL
    r = _window_rate(history, t, "kvtier_pressure_memory_stalled_seconds_total")
    if r is not None and r > t.value:
        yield _fire(t, f"memory PSI full {_pct(r)} > {_pct(t.value)}")

    t = th.MEMORY_AVAILABLE
    total, avail = cur.get("kvtier_memory_total_bytes"), cur.get("kvtier_memory_available_bytes")
    outside = (total or 0.0) - (cur.get("kvtier_memory_hugetlb_bytes") or 0.0)
    if avail is not None and outside > 0 and avail / outside < t.value:
        future = predict_linear(history, t, "kvtier_memory_available_bytes")
        if future is not None and future <= 0:
            yield _fire(t, f"MemAvailable {_pct(avail / outside)} < {_pct(t.value)}, falling")

    t = th.DIRECT_RECLAIM
    r = _window_rate(history, t, "kvtier_vmstat_allocstall_total")
    if r is not None and r > t.value:
        yield _fire(t, f"direct reclaim {r:.0f}/s > {t.value:g}/s")

    t = th.HIGH_ORDER_BLOCKS
    zones: dict[tuple[str, str], float] = {}
    for d, v in cur.series("kvtier_buddyinfo_blocks", zone="Normal"):
        if int(d["order"]) >= 9:
            key = (d["node"], d["zone"])
            zones[key] = zones.get(key, 0.0) + v
    for (node, _zone), blocks in zones.items():
        if blocks < t.value:
            yield _fire(t, f"node {node} Normal: {blocks:.0f} free order>=9 blocks")

    t = th.HUGEPAGE_POOL
    pool, free, rsvd = (
        cur.get("kvtier_hugepages_pool"),
        cur.get("kvtier_hugepages_free"),
        cur.get("kvtier_hugepages_reserved"),
    )
    if pool and free is not None and rsvd is not None and free - rsvd < t.value:
        yield _fire(t, f"hugepages {free - rsvd:.0f} of {pool:.0f} free")

    t = th.DIRTY_PAGES
    dirty, wb = cur.get("kvtier_memory_dirty_bytes"), cur.get("kvtier_memory_writeback_bytes")
    limit = cur.get("kvtier_memory_dirty_threshold_bytes")
    if dirty is not None and wb is not None and limit:
        share = (dirty + wb) / limit
        if share > t.value:
            yield _fire(t, f"dirty+writeback {_pct(share)} of threshold > {_pct(t.value)}")

    t = th.OOM_KILL
    inc = _window_increase(history, t, "kvtier_vmstat_oom_kill_total")
    if inc is not None and inc > t.value:
        yield _fire(t, f"{inc:.0f} OOM kills")


def _cache(history: History, cur: Scrape) -> Iterator[Firing]:
    for t, tier in ((th.L1_EVICTION_STORM, "l1"), (th.L2_SLOTS, "l2")):
        used = cur.get("kvtier_tier_used_bytes", tier=tier)
        cap = cur.get("kvtier_tier_capacity_bytes", tier=tier)
        if used is None or not cap or used / cap <= t.value:
            continue
        r = _window_rate(history, t, "kvtier_tier_evictions_total", tier=tier)
        if r is not None and r > t.rate:
            yield _fire(t, f"{tier.upper()} {_pct(used / cap)} full, {r:.0f} evictions/s")

    t = th.L3_SHEDDING
    r = _window_rate(history, t, "kvtier_shed_writes_total")
    if r is not None and r > t.value:
        yield _fire(t, f"shedding {r:.1f} writes/s")

    t = th.CHECKSUM_FAILURE
    inc = _window_increase(history, t, "kvtier_checksum_failures_total")
    if inc is not None and inc > t.value:
        yield _fire(t, f"{inc:.0f} checksum failures")

    t = th.COMMIT_FAILURES  # summed over every reason, as the rule's `sum without (reason)`
    base = history.baseline(t.window_s)
    incs = [
        m.increase(base, cur, "kvtier_commit_failures_total", labels)
        for labels in cur.samples.get("kvtier_commit_failures_total", {})
    ]
    if any(i is not None for i in incs):
        inc = sum(i[0] for i in incs if i is not None)
        if inc > t.value:
            yield _fire(t, f"{inc:.0f} commits failed (replies delivered)")

    t = th.L4_DOWN  # no series without an L4: nothing to judge
    breaker, up = cur.get("kvtier_l4_breaker_state"), cur.get("kvtier_l4_up")
    if breaker is not None and breaker >= t.value:
        yield _fire(t, "L4 breaker open" + (", Redis unreachable" if up == 0 else ""))
    elif up == 0:
        yield _fire(t, "L4 Redis unreachable")

    t = th.L4_ERRORS
    r = _window_rate(history, t, "kvtier_l4_errors_total")
    if r is not None and r > t.value:
        yield _fire(t, f"L4 {r:.1f} errors/s")

    t = th.L4_SHARD_NO_REPLICA  # only a Redis Cluster L4 has shards
    for d, replicas in cur.series("kvtier_l4_shard_replicas"):
        if replicas < t.value:
            yield _fire(t, f"L4 shard {d.get('shard', '?')} {replicas:.0f} replicas")

    t = th.SESSION_MOVES
    r = _window_rate(history, t, "kvtier_moved_sessions_total")
    if r is not None and r > t.value:
        yield _fire(t, f"{r * 60:.1f} sessions/min moved here")

    t = th.L3_FILESYSTEM
    avail, size = (
        cur.get("kvtier_l3_filesystem_avail_bytes"),
        cur.get("kvtier_l3_filesystem_size_bytes"),
    )
    if avail is not None and size and avail / size < t.value:
        future = predict_linear(history, t, "kvtier_l3_filesystem_avail_bytes")
        if future is not None and future < 0:
            yield _fire(t, f"L3 filesystem {_pct(avail / size)} free, filling")


def _devices(history: History, cur: Scrape) -> Iterator[Firing]:
    t = th.DEVICE_LOST
    lost = cur.get("kvtier_server_devices", state="lost")
    if lost is not None and lost > t.value:
        ok = cur.get("kvtier_server_devices", state="ok")
        yield _fire(t, f"{lost:.0f} device(s) lost, serving degraded on {ok or 0:.0f}")

    t = th.GPU_HEADROOM
    for d, total in cur.series("kvtier_gpu_memory_total_bytes"):
        free = cur.get("kvtier_gpu_memory_free_bytes", gpu=d["gpu"])
        if free is not None and total > 0 and free / total < t.value:
            yield _fire(t, f"GPU {d['gpu']} free {_pct(free / total)} < {_pct(t.value)}")

    t = th.PCIE_DOWNGRADE
    for d, width in cur.series("kvtier_gpu_pcie_link_width"):
        gpu = d["gpu"]
        max_width = cur.get("kvtier_gpu_pcie_link_max_width", gpu=gpu)
        gen = cur.get("kvtier_gpu_pcie_link_generation", gpu=gpu)
        max_gen = cur.get("kvtier_gpu_pcie_link_max_generation", gpu=gpu)
        load = (cur.get("kvtier_gpu_pcie_tx_bytes_per_second", gpu=gpu) or 0.0) + (
            cur.get("kvtier_gpu_pcie_rx_bytes_per_second", gpu=gpu) or 0.0
        )
        if max_width is not None and max_width - width >= t.value:
            yield _fire(t, f"GPU {gpu} link x{width:.0f} of x{max_width:.0f}")
        elif gen is not None and max_gen is not None and max_gen - gen >= t.value and load > t.rate:
            yield _fire(t, f"GPU {gpu} link gen{gen:.0f} of gen{max_gen:.0f} under load")

    t = th.GPU_ALLOC_RETRIES
    name = "kvtier_torch_alloc_retries_total"
    for d, _ in cur.series(name):
        inc = m.increase(history.baseline(t.window_s), cur, name, tuple(sorted(d.items())))
        if inc is not None and inc[0] > t.value:
            yield _fire(t, f"GPU {d.get('gpu', '?')} {inc[0]:.0f} cudaMalloc retries")

    t = th.GPU_ALLOC_FRAGMENTED
    for d, reserved in cur.series("kvtier_torch_reserved_bytes"):
        split = cur.get("kvtier_torch_inactive_split_bytes", **d)
        if split is not None and reserved > 0 and split / reserved > t.value and split > t.floor:
            yield _fire(
                t,
                f"GPU {d.get('gpu', '?')} {fmt.size(split)} ({_pct(split / reserved)}) of "
                f"{fmt.size(reserved)} reserved stranded in split blocks",
            )

    t = th.GPU_BUDGET  # no series without a plan (the CPU, a model across devices)
    used = cur.get("kvtier_gpu_memory_process_bytes")
    budget = cur.get("kvtier_gpu_memory_budget_bytes")
    if used is not None and budget and used / budget > t.value:
        yield _fire(
            t, f"GPU {fmt.size(used)} held > budget {fmt.size(budget)} ({_pct(used / budget)})"
        )
