"""kvtop's L4 row: figures from the kvtier_l4_* families, drawn at 80x24 and 120x40, hidden
when the endpoint has no L4, red when Redis is down."""

from __future__ import annotations

import re

import pytest
from test_kvtop_render import FIX, text

from ops.kvtop import metrics
from ops.kvtop.history import History
from ops.kvtop.l4 import l4_view
from ops.kvtop.metrics import Scrape
from ops.kvtop.model import Model, Options, build, parse_sessions

MIB = float(1 << 20)


def l4_samples(
    i: int, *, up: float = 1.0, breaker: float = 0.0, maxmemory: float = 512 * MIB
) -> dict:
    """What `kvtier serve` with an L4 exports, scrape `i` of a run (1 s apart): 2 MiB/s read,
    4 MiB/s written, 10 gets of 2 ms and 5 puts of 8 ms per second, 8 hits and 2 misses; the
    l4 tier (Redis's used memory against its maxmemory) and restores from l4."""
    tier = (("tier", "l4"),)
    return {
        "kvtier_tier_capacity_bytes": {tier: maxmemory},
        "kvtier_tier_used_bytes": {tier: 100 * MIB},
        "kvtier_tier_chunks": {tier: 40.0},
        "kvtier_tier_hits_total": {tier: 80.0 + 8 * i},
        "kvtier_tier_misses_total": {tier: 20.0 + 2 * i},
        "kvtier_restore_decisions_total": {(("src", "l4"),): 5.0 + i},
        "kvtier_l4_up": {(): up},
        "kvtier_l4_breaker_state": {(): breaker},
        "kvtier_l4_bytes_total": {
            (("direction", "read"),): 100 * MIB + 2 * MIB * i,
            (("direction", "written"),): 300 * MIB + 4 * MIB * i,
        },
        "kvtier_l4_hits_total": {(): 80.0 + 8 * i},
        "kvtier_l4_misses_total": {(): 20.0 + 2 * i},
        "kvtier_l4_errors_total": {(): 3.0},
        "kvtier_l4_writes_shed_total": {(): 7.0},
        "kvtier_l4_operation_seconds_count": {
            (("op", "get"),): 100.0 + 10 * i,
            (("op", "put"),): 50.0 + 5 * i,
        },
        "kvtier_l4_operation_seconds_sum": {
            (("op", "get"),): 1.0 + 0.02 * i,
            (("op", "put"),): 1.0 + 0.04 * i,
        },
    }


def live_history(l4: bool = True, **kw: float) -> History:
    h = History()
    for i, name in enumerate(("exporter-live-1.txt", "exporter-live-2.txt")):
        s = metrics.parse((FIX / name).read_text(), 100.0 + i)
        samples = {k: dict(v) for k, v in s.samples.items()}
        if l4:
            for name, series in l4_samples(i, **kw).items():
                samples[name] = {**samples.get(name, {}), **series}
        h.add(Scrape(s.taken_at, samples))
    return h


def model(l4: bool = True, **kw: float) -> Model:
    sessions = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    return build(live_history(l4, **kw), sessions, Options(), source="x", interval=1.0)


def test_l4_figures() -> None:
    v = model().l4
    assert v is not None and v.up and v.breaker == "closed"
    assert v.read_rate == pytest.approx(2 * MIB) and v.write_rate == pytest.approx(4 * MIB)
    assert v.get_seconds == pytest.approx(0.002) and v.put_seconds == pytest.approx(0.008)
    assert v.hit_ratio == pytest.approx(0.8)
    assert v.errors == 3 and v.errors_rate == 0 and v.shed == 7


def test_latency_since_start_when_nothing_ran_in_the_last_refresh() -> None:
    one = metrics.parse("", 1.0)
    cur = Scrape(2.0, l4_samples(0))
    v = l4_view(cur, one, None)
    assert v is not None and v.get_seconds == pytest.approx(0.01)  # 1 s over 100 gets
    assert v.read_rate is None  # one scrape: no rate, never a made-up 0


def test_no_l4_no_row() -> None:
    assert model(l4=False).l4 is None
    for size in ((80, 24), (120, 40)):
        lines = text(model(l4=False), *size)
        body = "\n".join(lines)
        assert "L4 " not in body and "breaker" not in body
        assert not any(re.search(r"│ l4 ", line) for line in lines)  # no restore row either


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)])
def test_l4_row_fits_and_keeps_the_layout(size: tuple[int, int]) -> None:
    width, height = size
    lines = text(model(), width, height)
    assert len(lines) == height and all(len(line) <= width for line in lines)
    body = "\n".join(lines)
    for title in ("[1] Tiers", "[2] Sessions", "[3] Restore", "[4] Host"):
        assert title in body
    assert body.count("╭") == body.count("╰") >= 4
    row = next(line for line in lines if re.search(r"│ L4 (up|DOWN) ", line))
    assert "…" not in row  # whole fields only
    assert "L4 up  breaker closed  hit 80%  mem 100M/512M  errors 3  shed 7" in row
    if width == 120:  # one column of panels (from 160 they sit side by side, half as wide)
        assert "shed 7  get 2ms put 8ms  read 2.00M/s write 4.00M/s" in row
    # the tier rows above it are all there; the restore panel has l4 and still recompute
    for tier in ("L1", "L2", "L3"):
        assert any(re.search(rf"│ {tier} ", line) for line in lines), tier
    assert any(re.search(r"│ l4 +\d", line) for line in lines)
    assert any(re.search(r"│ recompute +\d", line) for line in lines)


def test_redis_without_maxmemory_is_flagged() -> None:
    m = model(maxmemory=0.0)
    assert m.l4 is not None and m.l4.capacity == 0
    assert "mem 100M/no limit" in "\n".join(text(m, 120, 40))


def test_l4_down_is_red_and_alerted() -> None:
    m = model(up=0.0, breaker=2.0)
    lines = text(m, 120, 40)
    row = next(line for line in lines if re.search(r"│ L4 (up|DOWN) ", line))
    assert "L4 DOWN  breaker open" in row
    assert {a.alert for a in m.alerts} >= {"KvtierL4Down"}
    assert "L4Down L4 breaker open, Redis unreachable" in "\n".join(lines)
    half = model(up=0.0, breaker=1.0).l4
    assert half is not None and half.breaker == "half open" and not half.up
