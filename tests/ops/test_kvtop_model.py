"""kvtop's data layer on /metrics texts recorded from a real exporter (tests/fixtures/metrics):
parsing, rates between two scrapes, the history, percentiles, the session list and the alerts
judged with ops.thresholds. Expected numbers are worked out by hand from the fixture files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops import thresholds as th
from ops.exporter.rules import EXPRESSIONS
from ops.kvtop import alerts, metrics
from ops.kvtop.history import History
from ops.kvtop.metrics import MetricsFormatError, Scrape
from ops.kvtop.model import Options, build, headroom, parse_sessions

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
KIB = 1024


def load(name: str, at: float) -> Scrape:
    return metrics.parse((FIX / name).read_text(), at)


def live_history() -> History:
    h = History()
    h.add(load("exporter-live-1.txt", 100.0))
    h.add(load("exporter-live-2.txt", 101.0))
    return h


def test_parse_recorded_exporter_text() -> None:
    s = load("exporter-live-2.txt", 0.0)
    assert s.get("kvtier_tier_used_bytes", tier="l2") == 352256.0
    assert s.get("kvtier_tier_chunks", tier="l2") == 43.0
    assert s.get("kvtier_sessions", state="pinned") == 1.0
    assert s.get("kvtier_transfer_bytes_total", src="l2", dst="l1") == 409088.0
    assert s.get("kvtier_tier_used_bytes", tier="l4") is None
    assert s.total("kvtier_sessions") == 7.0  # active 1 + idle 3 + hibernated 2 + pinned 1


def test_parse_refuses_what_is_not_prometheus_text() -> None:
    with pytest.raises(MetricsFormatError, match="Point --url at a kvtier serve"):
        metrics.parse('{"object": "list", "data": []}', 0.0)


def test_tier_rates_from_two_scrapes() -> None:
    model = build(live_history(), None, Options(), source="x", interval=1.0)
    l1, l2, l3 = model.tiers
    # into L1: l2->l1 went 341504 -> 409088 in 1 s
    assert l1.in_rate == 409088 - 341504
    # out of L2: l2->l1 (+67584) and l2->l3 (244736 -> 250368, +5632)
    assert l2.out_rate == 67584 + 5632
    assert l3.in_rate == 5632 and l3.out_rate == 0.0
    assert l2.used == 352256 and l2.capacity == 1 << 20 and l2.chunks == 43
    assert l2.hit_ratio == pytest.approx(61 / 75)
    assert l3.queue == 0 and l3.read_queue == 0 and l1.queue is None
    assert l1.in_spark == (67584.0,)


def test_counter_reset_gives_no_rate() -> None:
    a = Scrape(0.0, {"c_total": {(): 100.0}})
    b = Scrape(1.0, {"c_total": {(): 5.0}})
    assert metrics.rate(a, b, "c_total") is None
    assert metrics.rate(b, Scrape(3.0, {"c_total": {(): 9.0}}), "c_total") == 2.0
    assert metrics.rate(None, b, "c_total") is None


def test_quantile_matches_histogram_quantile() -> None:
    # 10 observations: 2 <= 0.1, 8 <= 0.5, 10 <= 1.0
    b = [(0.1, 2.0), (0.5, 8.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert metrics.quantile(0.5, b) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert metrics.quantile(0.9, b) == pytest.approx(0.5 + 0.5 * (9 - 8) / 2)
    assert metrics.quantile(0.1, b) == pytest.approx(0.05)
    # a rank in the +Inf bucket: Prometheus answers the highest finite bound
    assert metrics.quantile(0.99, [(0.1, 1.0), (float("inf"), 5.0)]) == 0.1
    assert metrics.quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_restore_rows_from_the_recorded_server() -> None:
    h = History()
    h.add(load("serve-1.txt", 10.0))
    h.add(load("serve-2.txt", 11.0))
    model = build(h, None, Options(), source="x", interval=1.0)
    assert model.restore_metric == "TTFT"
    rows = {r.src: r for r in model.restore}
    assert [r.src for r in model.restore] == ["l1", "l2", "l3", "recompute"]
    # decisions: l1 6, l2 9, l3 0, recompute 2 -> shares of 17
    assert rows["l2"].decisions == 9 and rows["l2"].share == pytest.approx(9 / 17)
    # the l2 TTFT histogram gained 4 observations between the scrapes: quantiles are recent
    assert rows["l2"].recent and rows["l2"].observed == 4
    # l1 saw none in between: its quantiles are since start, over its 6 observations
    assert not rows["l1"].recent and rows["l1"].observed == 6


def test_sessions_sorted_filtered_and_counted() -> None:
    s = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    assert len(s.sessions) == 6
    h = live_history()
    by_bytes = build(h, s, Options(), source="x", interval=1.0).sessions
    # active first, then idle, then hibernated; by bytes within each state
    rank = {"active": 0, "idle": 1, "hibernated": 2}
    want = sorted(s.sessions, key=lambda r: (rank[r.state], -r.bytes))
    assert [(r.state, r.bytes) for r in by_bytes.rows] == [(r.state, r.bytes) for r in want]
    assert dict(by_bytes.by_state) == {"active": 1, "idle": 3, "hibernated": 2, "pinned": 1}
    acme = build(h, s, Options(tenant="acme", sort="tenant"), source="x", interval=1.0).sessions
    assert {r.tenant for r in acme.rows} == {"acme"} and acme.total == 3
    assert [r.session_id for r in acme.rows] == sorted(r.session_id for r in acme.rows)


def test_parse_sessions_rejects_other_json() -> None:
    with pytest.raises(ValueError, match="'data' list"):
        parse_sessions('{"status": "ok"}')


def test_history_keeps_a_minute_and_a_sparse_long_record() -> None:
    h = History(window_s=60, long_window_s=600, long_step_s=15)
    for t in range(0, 700):
        h.add(Scrape(float(t), {}))
    assert h.latest is not None and h.latest.taken_at == 699.0
    assert h.previous is not None and h.previous.taken_at == 698.0
    recent = [s.taken_at for s in h.points(60)]
    assert recent[0] == 639.0 and len(recent) == 61
    base = h.baseline(300)
    assert base is not None and 699 - base.taken_at <= 300 and 699 - base.taken_at > 280
    assert h.baseline(600) is not None
    assert len(h) < 61 + 600 // 15 + 2  # sparse beyond the minute
    h.add(Scrape(699.0, {}))  # a clock that did not move is ignored
    assert h.previous is not None and h.previous.taken_at == 698.0


def test_headroom_counts_higher_orders_as_order9_blocks() -> None:
    assert headroom([5, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3]) == 2 + 3 * 2
    assert headroom([5, 4, 3]) == 0


# ---- alerts: each rule's condition, just past and just short of its threshold ----------------


def scrape(at: float, **series: dict) -> Scrape:
    return Scrape(
        at, {k: {tuple(sorted(lab.items())): v for lab, v in s} for k, s in series.items()}
    )


def one(value: float, **labels: str) -> list:
    return [(labels, value)]


def firing(*scrapes: Scrape) -> set[str]:
    h = History()
    for s in scrapes:
        h.add(s)
    return {f.alert for f in alerts.judge(h)}


T = th  # the one source of the numbers


def cases() -> list[tuple[str, list[Scrape], list[Scrape]]]:
    """(alert, scrapes that fire it, scrapes just short of it)."""
    gib = float(1 << 30)
    psi = "kvtier_pressure_memory_stalled_seconds_total"
    v = T.MEMORY_PSI_FULL.value
    out = [
        (
            T.MEMORY_PSI_FULL.alert,
            [scrape(0, **{psi: one(0)}), scrape(10, **{psi: one(10 * v * 1.1)})],
            [scrape(0, **{psi: one(0)}), scrape(10, **{psi: one(10 * v * 0.9)})],
        )
    ]
    mem = {
        "kvtier_memory_total_bytes": one(100 * gib),
        "kvtier_memory_hugetlb_bytes": one(20 * gib),
    }
    low = T.MEMORY_AVAILABLE.value * 80 * gib
    out.append(
        (
            T.MEMORY_AVAILABLE.alert,
            [
                scrape(0, **mem, kvtier_memory_available_bytes=one(low * 0.99)),
                scrape(60, **mem, kvtier_memory_available_bytes=one(low * 0.9)),
            ],
            [  # below the share but not falling
                scrape(0, **mem, kvtier_memory_available_bytes=one(low * 0.9)),
                scrape(60, **mem, kvtier_memory_available_bytes=one(low * 0.9)),
            ],
        )
    )
    stall = "kvtier_vmstat_allocstall_total"
    r = T.DIRECT_RECLAIM.value
    out.append(
        (
            T.DIRECT_RECLAIM.alert,
            [scrape(0, **{stall: one(0)}), scrape(10, **{stall: one(10 * r + 10)})],
            [scrape(0, **{stall: one(0)}), scrape(10, **{stall: one(10 * r)})],
        )
    )
    blocks = "kvtier_buddyinfo_blocks"

    def zone(o9: float) -> Scrape:
        rows = [({"node": "0", "zone": "Normal", "order": str(o)}, 50.0) for o in range(9)]
        rows += [({"node": "0", "zone": "Normal", "order": "9"}, o9)]
        rows += [({"node": "0", "zone": "Normal", "order": "10"}, 0.0)]
        rows += [({"node": "0", "zone": "DMA", "order": "9"}, 0.0)]
        return scrape(0, **{blocks: rows})

    out.append((T.HIGH_ORDER_BLOCKS.alert, [zone(0)], [zone(T.HIGH_ORDER_BLOCKS.value)]))

    def huge(free: float, rsvd: float) -> Scrape:
        return scrape(
            0,
            kvtier_hugepages_pool=one(512),
            kvtier_hugepages_free=one(free),
            kvtier_hugepages_reserved=one(rsvd),
        )

    out.append((T.HUGEPAGE_POOL.alert, [huge(10, 10)], [huge(11, 10)]))

    def gpu(free: float) -> Scrape:
        return scrape(
            0,
            kvtier_gpu_memory_total_bytes=one(100.0, gpu="0"),
            kvtier_gpu_memory_free_bytes=one(free, gpu="0"),
        )

    g = T.GPU_HEADROOM.value * 100
    out.append((T.GPU_HEADROOM.alert, [gpu(g - 0.1)], [gpu(g + 0.1)]))

    def tier(t: th.Threshold, name: str, used: float, evicted: float) -> list[Scrape]:
        cap = {"kvtier_tier_capacity_bytes": one(1000.0, tier=name)}
        used_s = {"kvtier_tier_used_bytes": one(used, tier=name)}
        return [
            scrape(0, **cap, **used_s, kvtier_tier_evictions_total=one(0.0, tier=name)),
            scrape(10, **cap, **used_s, kvtier_tier_evictions_total=one(evicted, tier=name)),
        ]

    for t, name in ((T.L1_EVICTION_STORM, "l1"), (T.L2_SLOTS, "l2")):
        full = t.value * 1000 + 1
        out.append(
            (t.alert, tier(t, name, full, 10 * t.rate + 1), tier(t, name, full, 10 * t.rate))
        )
    fs = {"kvtier_l3_filesystem_size_bytes": one(1000.0)}
    f = T.L3_FILESYSTEM.value * 1000
    out.append(
        (
            T.L3_FILESYSTEM.alert,
            [
                scrape(0, **fs, kvtier_l3_filesystem_avail_bytes=one(f - 1)),
                scrape(60, **fs, kvtier_l3_filesystem_avail_bytes=one(f - 50)),
            ],
            [
                scrape(0, **fs, kvtier_l3_filesystem_avail_bytes=one(f + 50)),
                scrape(60, **fs, kvtier_l3_filesystem_avail_bytes=one(f + 1)),
            ],
        )
    )
    for t, name in (
        (T.L3_SHEDDING, "kvtier_shed_writes_total"),
        (T.CHECKSUM_FAILURE, "kvtier_checksum_failures_total"),
        (T.COMMIT_FAILURES, "kvtier_commit_failures_total"),
        (T.OOM_KILL, "kvtier_vmstat_oom_kill_total"),
    ):
        out.append(
            (
                t.alert,
                [scrape(0, **{name: one(3)}), scrape(10, **{name: one(4)})],
                [scrape(0, **{name: one(4)}), scrape(10, **{name: one(4)})],
            )
        )

    def dirty(share: float) -> Scrape:
        return scrape(
            0,
            kvtier_memory_dirty_bytes=one(share * 800),
            kvtier_memory_writeback_bytes=one(share * 200),
            kvtier_memory_dirty_threshold_bytes=one(1000.0),
        )

    d = T.DIRTY_PAGES.value
    out.append((T.DIRTY_PAGES.alert, [dirty(d + 0.01)], [dirty(d - 0.01)]))

    def devices(lost: float) -> Scrape:
        rows = [({"state": "ok"}, 2.0 - lost), ({"state": "lost"}, lost)]
        return scrape(0, kvtier_server_devices=rows)

    out.append((T.DEVICE_LOST.alert, [devices(1)], [devices(0)]))

    def link(width: float, gen: float, load: float) -> Scrape:
        return scrape(
            0,
            kvtier_gpu_pcie_link_width=one(width, gpu="0"),
            kvtier_gpu_pcie_link_max_width=one(16, gpu="0"),
            kvtier_gpu_pcie_link_generation=one(gen, gpu="0"),
            kvtier_gpu_pcie_link_max_generation=one(5, gpu="0"),
            kvtier_gpu_pcie_tx_bytes_per_second=one(load, gpu="0"),
            kvtier_gpu_pcie_rx_bytes_per_second=one(0, gpu="0"),
        )

    rate = T.PCIE_DOWNGRADE.rate
    out.append((T.PCIE_DOWNGRADE.alert, [link(8, 5, 0)], [link(16, 4, rate)]))
    out.append((T.PCIE_DOWNGRADE.alert, [link(16, 4, rate + 1)], [link(16, 1, 0)]))
    retries = "kvtier_torch_alloc_retries_total"
    out.append(
        (
            T.GPU_ALLOC_RETRIES.alert,
            [scrape(0, **{retries: one(3, gpu="0")}), scrape(10, **{retries: one(4, gpu="0")})],
            [scrape(0, **{retries: one(4, gpu="0")}), scrape(10, **{retries: one(4, gpu="0")})],
        )
    )

    def alloc(reserved: float, split: float) -> Scrape:
        return scrape(
            0,
            kvtier_torch_reserved_bytes=one(reserved, gpu="0"),
            kvtier_torch_inactive_split_bytes=one(split, gpu="0"),
        )

    frag, floor = T.GPU_ALLOC_FRAGMENTED.value, T.GPU_ALLOC_FRAGMENTED.floor
    big = 100 * floor
    out.append(
        (T.GPU_ALLOC_FRAGMENTED.alert, [alloc(big, big * frag + 1)], [alloc(big, big * frag)])
    )
    # a large share of a pool too small to matter: under the floor, quiet
    out.append(
        (T.GPU_ALLOC_FRAGMENTED.alert, [alloc(2 * floor, floor + 1)], [alloc(2 * floor, floor)])
    )

    def plan(used: float) -> Scrape:
        return scrape(
            0,
            kvtier_gpu_memory_budget_bytes=one(100 * gib),
            kvtier_gpu_memory_process_bytes=one(used),
        )

    b = T.GPU_BUDGET.value * 100 * gib
    out.append((T.GPU_BUDGET.alert, [plan(b + 1)], [plan(b)]))
    out.append((T.GPU_BUDGET.alert, [plan(b + 1)], [scrape(0)]))  # no plan (the CPU): quiet

    def l4(breaker: float, up: float) -> Scrape:
        return scrape(0, kvtier_l4_breaker_state=one(breaker), kvtier_l4_up=one(up))

    down = T.L4_DOWN
    out.append((down.alert, [l4(down.value, 0)], [l4(down.value - 1, 1)]))  # open / half open
    out.append((down.alert, [l4(down.value - 1, 0)], [l4(0, 1)]))  # probing, still unreachable
    out.append((down.alert, [l4(down.value, 1)], [scrape(0)]))  # no L4 configured: quiet
    errors, e = "kvtier_l4_errors_total", T.L4_ERRORS.value
    out.append(
        (
            T.L4_ERRORS.alert,
            [scrape(0, **{errors: one(0)}), scrape(10, **{errors: one(10 * e + 1)})],
            [scrape(0, **{errors: one(0)}), scrape(10, **{errors: one(10 * e)})],
        )
    )

    def shards(replicas: float) -> Scrape:
        rows = [
            ({"shard": "10.0.0.1:7000", "slots": "0-8191"}, 1.0),
            ({"shard": "10.0.0.2:7001", "slots": "8192-16383"}, replicas),
        ]
        return scrape(0, kvtier_l4_shard_replicas=rows)

    n = T.L4_SHARD_NO_REPLICA.value
    out.append((T.L4_SHARD_NO_REPLICA.alert, [shards(n - 1)], [shards(n)]))
    out.append((T.L4_SHARD_NO_REPLICA.alert, [shards(0)], [scrape(0)]))  # one server: no shards
    moved, mv = "kvtier_moved_sessions_total", T.SESSION_MOVES.value
    out.append(
        (
            T.SESSION_MOVES.alert,
            [scrape(0, **{moved: one(0)}), scrape(100, **{moved: one(100 * mv + 1)})],
            [scrape(0, **{moved: one(0)}), scrape(100, **{moved: one(100 * mv)})],
        )
    )
    return out


@pytest.mark.parametrize("alert,fire,quiet", cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_alert_fires_past_its_threshold_only(alert: str, fire: list, quiet: list) -> None:
    assert alert in firing(*fire)
    assert alert not in firing(*quiet)


def test_every_alert_rule_has_a_kvtop_check() -> None:
    covered = {c[0] for c in cases()}
    assert covered == set(EXPRESSIONS) == {t.alert for t in th.ALL}


def test_recorded_live_exporter_fires_nothing() -> None:
    """The dev machine's recording: a healthy host, an idle-ish cache."""
    assert build(live_history(), None, Options(), source="x", interval=1.0).alerts == ()


def test_h200_recording_fires_checksum_once_watched() -> None:
    """The H200 recording's cache snapshot has a checksum failure; one failure more between
    two scrapes (all else equal) makes the rule's `increase(...) > 0` true."""
    text = (FIX / "h200.txt").read_text()
    before = metrics.parse(text, 0.0)
    after = metrics.parse(
        text.replace("kvtier_checksum_failures_total 1.0", "kvtier_checksum_failures_total 2.0"),
        30.0,
    )
    assert before.get("kvtier_checksum_failures_total") == 1.0
    assert firing(before, after) == {T.CHECKSUM_FAILURE.alert}
