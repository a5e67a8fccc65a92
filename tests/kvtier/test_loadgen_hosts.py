"""kvtier loadgen over several servers: each session's turns go round the hosts; the server-side
figures are summed over them and kept per host; L4 hits are reported beside the other tiers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_proc import ROOT, Server

from kvtier.loadgen import LoadConfig, Sample
from kvtier.loadgen_hosts import by_host, fleet_ttft, host_lines, host_of, merge_tiers
from kvtier.loadgen_metrics import server_ttft
from kvtier.loadgen_report import format_report, report, tiers_during, tiers_now

SCRAPES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"

# What `kvtier serve` with an L4 adds to /metrics (ops.exporter.l4), for a host that served 30
# chunks from Redis.
L4_TEXT = """\
# TYPE kvtier_l4_up gauge
kvtier_l4_up 1.0
# TYPE kvtier_l4_breaker_state gauge
kvtier_l4_breaker_state 0.0
# TYPE kvtier_l4_bytes_total counter
kvtier_l4_bytes_total{direction="read"} 7340032.0
kvtier_l4_bytes_total{direction="written"} 14680064.0
# TYPE kvtier_l4_hits_total counter
kvtier_l4_hits_total 30.0
# TYPE kvtier_l4_misses_total counter
kvtier_l4_misses_total 4.0
# TYPE kvtier_l4_errors_total counter
kvtier_l4_errors_total 1.0
"""


def test_turns_go_round_the_hosts() -> None:
    assert [host_of(0, t, 2) for t in range(4)] == [0, 1, 0, 1]
    assert [host_of(1, t, 2) for t in range(4)] == [1, 0, 1, 0]
    assert [host_of(5, t, 1) for t in range(3)] == [0, 0, 0]
    assert [host_of(0, t, 3) for t in range(4)] == [0, 1, 2, 0]
    assert LoadConfig().hosts() == ("http://127.0.0.1:8000",)
    assert LoadConfig(url="a", urls=("b", "c")).hosts() == ("b", "c")


def test_server_ttft_of_two_hosts_is_the_sum() -> None:
    before = (SCRAPES / "serve-1.txt").read_text()
    after = (SCRAPES / "serve-2.txt").read_text()
    one = server_ttft(before, after)
    two = fleet_ttft([(before, after), (before, after), (before, None)])
    assert two["overall"]["n"] == 2 * one["overall"]["n"] == 10
    assert two["l2"]["n"] == 8 and two["l2"]["mean"] == pytest.approx(one["l2"]["mean"])
    assert two["l2"]["p50"] == pytest.approx(one["l2"]["p50"])
    assert fleet_ttft([(None, None)]) == {}


def test_l4_hits_are_reported_beside_the_tiers() -> None:
    plain = tiers_now((SCRAPES / "serve-2.txt").read_text())
    assert plain["l4"] is None and plain["hits_by_tier"] == {"l1": 6, "l2": 45, "l3": 0}
    with_l4 = tiers_now((SCRAPES / "serve-2.txt").read_text() + L4_TEXT)
    assert with_l4["hits_by_tier"] == {"l1": 6, "l2": 45, "l3": 0, "l4": 30}
    assert with_l4["l4"] == {
        "hits": 30, "misses": 4, "errors": 1, "up": True, "bytes_read": 7 << 20,
    }  # fmt: skip
    text = format_report(report(LoadConfig(), [], 1.0, None, None, with_l4))
    assert "  Redis (L4) up: 30 hits, 4 misses, 1 error, 7.0 MiB read" in text
    assert "hits by tier: l1 6, l2 45, l3 0, l4 30" in text
    assert "l4" not in format_report(report(LoadConfig(), [], 1.0, None, None, plain))


def test_two_hosts_merged_and_kept_apart() -> None:
    a = tiers_now((SCRAPES / "serve-2.txt").read_text() + L4_TEXT)
    b = tiers_now((SCRAPES / "serve-1.txt").read_text())
    both = merge_tiers([a, b])
    assert both["hits_by_tier"] == {"l1": 12, "l2": 70, "l3": 0, "l4": 30}
    # The l4 tier is one Redis that every host reports: its bytes count once, hits add up.
    redis = {"used_bytes": 100, "capacity_bytes": 512, "chunks": 7, "hits": 3}
    shared = merge_tiers([{**a, "tiers": {"l4": redis}}, {**a, "tiers": {"l4": redis}}])
    assert shared["tiers"]["l4"] == {**redis, "hits": 6}
    assert both["tiers"]["l3"]["capacity_bytes"] == 2 * a["tiers"]["l3"]["capacity_bytes"]
    assert both["tiers"]["l2"]["hits"] == 70 and both["l4"]["hits"] == 30
    assert both["restore_decisions"] == {
        k: a["restore_decisions"].get(k, 0) + b["restore_decisions"].get(k, 0)
        for k in both["restore_decisions"]
    }
    samples = [
        Sample(0, 0, 0.0, source="recompute", ttft=0.5, host="http://a"),
        Sample(0, 1, 1.0, source="l4", ttft=0.1, host="http://b"),
        Sample(1, 0, 0.0, source="recompute", ttft=0.5, host="http://b"),
        Sample(1, 1, 1.0, error="http 500: x", host="http://a"),
    ]
    hosts = by_host(samples, ("http://a", "http://b"), [a, None])
    assert hosts["http://a"] == {
        "requests": 2, "by_source": {"recompute": 1}, "hits_by_tier": a["hits_by_tier"],
    }  # fmt: skip
    assert hosts["http://b"]["by_source"] == {"l4": 1, "recompute": 1}
    lines = host_lines(hosts)
    assert lines[1] == "per host (each session's turns went round the 2 hosts):"
    assert "  http://b: 2 requests (1 l4, 1 recompute)" in lines
    assert host_lines({"http://a": hosts["http://a"]}) == []


def test_hits_and_restores_are_the_runs_not_since_the_server_started() -> None:
    """Two real scrapes, before and after a run: the report's counters are their difference;
    bytes, chunks and sessions are as after it."""
    before = (SCRAPES / "serve-1.txt").read_text()
    after = (SCRAPES / "serve-2.txt").read_text()
    run = tiers_during(before + L4_TEXT.replace("30.0", "10.0"), after + L4_TEXT)
    assert run["counted"] == "during the run"
    assert run["hits_by_tier"] == {"l1": 0, "l2": 20, "l3": 0, "l4": 20}
    assert run["restore_decisions"] == {"l1": 0, "l2": 4, "l3": 0, "recompute": 1}
    assert run["tiers"]["l2"]["hits"] == 20
    assert run["l4"]["hits"] == 20 and run["l4"]["misses"] == 0 and run["l4"]["up"]
    assert run["tiers"] == {
        t: {**v, "hits": run["tiers"][t]["hits"]} for t, v in tiers_now(after)["tiers"].items()
    }  # sizes and chunks: now
    assert run["sessions"] == tiers_now(after)["sessions"]
    text = format_report(report(LoadConfig(), [], 1.0, None, None, run))
    assert "(hits and restores: during the run, the counters' change over it)" in text
    assert "restores: 0 from l1, 4 from l2, 0 from l3, 1 recomputed" in text
    # No scrape before the run: the totals, and the report says so.
    total = tiers_during(None, after)
    assert total["restore_decisions"] == tiers_now(after)["restore_decisions"]
    text = format_report(report(LoadConfig(), [], 1.0, None, None, total))
    assert "(hits and restores: since the server started; no scrape before the run)" in text
    assert merge_tiers([run, run])["counted"] == "during the run"
    assert merge_tiers([run, total])["counted"].startswith("since the server started")


def test_the_same_url_twice_is_refused() -> None:
    cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", "http://x:1", "--url", "http://x:1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the same --url twice" in done.stderr


@pytest.mark.timeout(600)
def test_fleet_alternates_turns_between_two_real_servers(tmp_path: Path) -> None:
    """Two `kvtier serve` with their own L3 roots and no L4: every session's turns alternate
    between them, and the report shows each host. Without an L4 neither /metrics has a
    kvtier_l4_ series."""
    servers = [
        Server(tmp_path / f"l3-{n}", "--l1-bytes", "32MiB", "--l2-bytes", "32MiB",
               module="ops.cli serve")
        for n in ("a", "b")
    ]  # fmt: skip
    try:
        for s in servers:
            s.start(timeout=180)
        a, b = (s.url for s in servers)
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", a, "--url", b]
        cmd += ["--sessions", "3", "--turns", "4", "--think-ms", "100", "--max-tokens", "4"]
        cmd += ["--system-chars", "600", "--compare", "2", "--out", str(out), "--png", str(png)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())
        assert result["requests"] == 12 and result["ok"] == 12, result["errors"]
        assert result["config"]["urls"] == [a, b]
        hosts = (a, b)
        for s in result["samples"]:
            assert s["host"] == hosts[(s["session"] + s["turn"]) % 2], s
        assert {h: v["requests"] for h, v in result["hosts"].items()} == {a: 6, b: 6}
        assert result["server_ttft_ms"]["overall"]["n"] == 12
        assert "per host (each session's turns went round the 2 hosts):" in done.stdout
        assert "hits by tier: l1 " in done.stdout
        for url in hosts:
            metrics = httpx.get(url + "/metrics", timeout=10).text
            assert "kvtier_tier_used_bytes" in metrics  # the cache's families are there
            assert "kvtier_l4_" not in metrics  # and no L4 family at all: absent, not zero
    finally:
        for s in servers:
            if s.proc is not None:
                assert s.stop() == 0
