"""The L4 (Redis) families: built from the cache's L4 stats, absent without an L4."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_inputs import L4_STATS, SnapshotWithL4, full_cache_snapshot, without_l4

from ops.exporter import CacheCollector
from ops.exporter.l4 import BREAKER_STATES, l4_families, l4_stats


def samples(snapshot: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def l4_names(found: dict) -> set[str]:
    return {name for name, _ in found if name.startswith("kvtier_l4_")}


def test_every_l4_figure_is_exported() -> None:
    got = samples(full_cache_snapshot())
    assert got[("kvtier_l4_up", ())] == 1
    assert got[("kvtier_l4_breaker_state", ())] == 0
    assert got[("kvtier_l4_bytes_total", (("direction", "read"),))] == 7 << 20
    assert got[("kvtier_l4_bytes_total", (("direction", "written"),))] == 14 << 20
    assert got[("kvtier_l4_hits_total", ())] == 30
    assert got[("kvtier_l4_misses_total", ())] == 4
    assert got[("kvtier_l4_errors_total", ())] == 2
    assert got[("kvtier_l4_writes_shed_total", ())] == 5
    assert got[("kvtier_l4_operation_seconds_count", (("op", "get"),))] == 34
    assert got[("kvtier_l4_operation_seconds_sum", (("op", "get"),))] == 0.75
    assert got[("kvtier_l4_operation_seconds_count", (("op", "put"),))] == 20
    assert got[("kvtier_l4_operation_seconds_sum", (("op", "put"),))] == 1.5
    # the rest of the snapshot is exported as before
    assert got[("kvtier_tier_hits_total", (("tier", "l2"),))] == 900


def test_no_l4_no_series() -> None:
    """Absent, not zero: a snapshot without L4 stats (or with None) has no kvtier_l4_ series."""
    assert l4_names(samples(without_l4(full_cache_snapshot()))) == set()
    assert l4_names(samples(replace(full_cache_snapshot(), l4=None))) == set()
    assert list(l4_families(None)) == []


def test_breaker_and_down() -> None:
    for state, value in BREAKER_STATES.items():
        fams = {f.name: f for f in l4_families({**L4_STATS, "up": False, "breaker": state})}
        assert fams["kvtier_l4_breaker_state"].samples[0].value == value
        assert fams["kvtier_l4_up"].samples[0].value == 0
    assert BREAKER_STATES["open"] == 2
    # an unknown breaker state gives no breaker series (never a made-up number)
    fams = {f.name for f in l4_families({**L4_STATS, "breaker": "melted"})}
    assert "kvtier_l4_breaker_state" not in fams and "kvtier_l4_up" in fams


def test_missing_counters_read_as_zero_and_the_url_is_never_a_label() -> None:
    fams = list(l4_families({"up": True, "breaker": "open", "url": "redis://:pw@h:1/0"}))
    for f in fams:
        for s in f.samples:
            assert "pw" not in repr(s.labels)
    hits = next(f for f in fams if f.name == "kvtier_l4_hits")
    assert hits.samples[0].value == 0


def test_l4_stats_reads_every_shape() -> None:
    assert l4_stats(without_l4(full_cache_snapshot())) is None  # no L4 configured
    assert l4_stats(full_cache_snapshot()) == L4_STATS
    assert l4_stats({"l4": L4_STATS}) == L4_STATS
    assert l4_stats({"tiers": ()}) is None

    class Subscriptable:
        def __getitem__(self, key: str) -> Any:
            if key != "l4":
                raise KeyError(key)
            return L4_STATS

    assert l4_stats(Subscriptable()) == L4_STATS

    @dataclass(frozen=True)
    class L4Reading:
        up: bool
        breaker: str
        hits: int

    found = l4_stats(SnapshotWithL4(taken_at=0.0, tiers=(), l4=L4Reading(False, "open", 3)))
    assert found == {"up": False, "breaker": "open", "hits": 3}
    assert l4_stats(SnapshotWithL4(taken_at=0.0, tiers=(), l4="not stats")) is None


def test_restore_source_l4_only_with_an_l4() -> None:
    """A cache counts every restore source, l4 included; without an L4 its zero is left out,
    with one l4 is always there (0 until the first restore from it)."""
    base = without_l4(full_cache_snapshot())
    counted = replace(base, restore_decisions=(*base.restore_decisions, ("l4", 0)))
    got = samples(counted)
    assert ("kvtier_restore_decisions_total", (("src", "l4"),)) not in got
    assert ("kvtier_restored_tokens_total", (("src", "l4"),)) not in got
    assert got[("kvtier_restore_decisions_total", (("src", "recompute"),))] == 2
    with_l4 = samples(full_cache_snapshot())  # restore_decisions without an l4 entry
    assert with_l4[("kvtier_restore_decisions_total", (("src", "l4"),))] == 0
    assert with_l4[("kvtier_restored_tokens_total", (("src", "l4"),))] == 0
    used = replace(full_cache_snapshot(), restore_decisions=(("l4", 5),), restored_tokens=())
    assert samples(used)[("kvtier_restore_decisions_total", (("src", "l4"),))] == 5
    # a count that is not zero is never hidden, L4 or not
    odd = samples(replace(base, restore_decisions=(("l4", 1),)))
    assert odd[("kvtier_restore_decisions_total", (("src", "l4"),))] == 1
