"""The loadgen report with real numbers: those of the demo run that told the wrong story
(client-side TTFT l2 2125 ms, l3 2487 ms, recompute 616 ms, while the server timed l3 at 85 ms
and recompute at 767 ms), scrapes of a running `kvtier serve`, and the server's own histogram."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtier.loadgen import LoadConfig, Sample
from kvtier.loadgen_metrics import histogram_quantile, server_ttft
from kvtier.loadgen_report import (
    compare_pairs,
    format_report,
    plot,
    report,
    tiers_now,
)
from kvtier.server.metrics import ServerMetrics

SCRAPES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
WRONG_PLURAL = re.compile(r"(?<![\d.])1 (requests|probes|chunks|errors|tokens|sessions|hits)\b")


def test_server_ttft_is_the_difference_of_two_real_scrapes() -> None:
    before = (SCRAPES / "serve-1.txt").read_text()
    after = (SCRAPES / "serve-2.txt").read_text()
    got = server_ttft(before, after)
    # l1 saw no request between the scrapes; l2 saw 4 (0.1-0.25 s: 2, 0.25-0.5: 1, 0.5-1: 1).
    assert list(got) == ["overall", "l2", "recompute"]
    l2 = got["l2"]
    assert l2["n"] == 4 and l2["p50"] == 250.0 and round(l2["p95"], 6) == 900.0
    assert round(l2["mean"], 3) == round((2.315078044000302 - 1.009083936000252) / 4 * 1000, 3)
    assert got["recompute"]["n"] == 1 and got["overall"]["n"] == 5
    # A restarted server (counters back at zero): the later scrape is taken alone.
    assert server_ttft(after, before)["l2"]["n"] == 5


def test_histogram_quantile_as_prometheus() -> None:
    buckets = {0.05: 0.0, 0.1: 4.0, 0.25: 4.0, float("inf"): 4.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.075)
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 3.0}) == 1.0  # past the last bound
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None


def server_scrapes() -> tuple[str, str]:
    """/metrics before and after a run, from the server's own metric definitions."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    for _ in range(3):
        metrics.ttft("l1", 0.004)  # before the run: not part of it
    before = generate_latest(registry).decode()
    for s in (0.06, 0.07):
        for _ in range(5):
            metrics.ttft("l2", s)
    for s in (0.080, 0.085, 0.085, 0.090):
        metrics.ttft("l3", s)
    for _ in range(4):
        metrics.ttft("recompute", 0.767)
    return before, generate_latest(registry).decode()


def issue_result() -> dict:
    """A demo run as first reported: 4 concurrent slots, 32 sessions on 2 cores."""
    samples = []
    for i, (source, ttft, n) in enumerate(
        [("l2", 2.125, 10), ("l3", 2.487, 4), ("recompute", 0.616, 4)]
    ):
        for k in range(n):
            s = Sample(i * 100 + k, 1, float(k), source=source, status=200, ttft=ttft)
            s.itl, s.prompt_tokens, s.completion_tokens = [0.02, 0.03], 1500, 3
            samples.append(s)
    samples.append(Sample(999, 1, 5.0, status=429, error="http 429: busy"))
    pairs = [
        {"session": k, "source": "l3", "restore_s": 0.085, "recompute_s": 0.767,
         "prompt_tokens": 1800}
        for k in range(4)
    ] + [
        {"session": 4 + k, "source": "recompute", "restore_s": 0.70, "recompute_s": 0.71,
         "prompt_tokens": 1700}
        for k in range(4)
    ]  # fmt: skip
    before, after = server_scrapes()
    tiers = tiers_now((SCRAPES / "serve-2.txt").read_text())
    return report(
        LoadConfig(sessions=32), samples, 61.2, compare_pairs(pairs), server_ttft(before, after),
        tiers,
    )  # fmt: skip


def test_report_puts_server_side_beside_client_side_and_names_the_queue() -> None:
    result = issue_result()
    server = result["server_ttft_ms"]
    assert (server["l3"]["n"], round(server["l3"]["mean"], 6)) == (4, 85.0)
    assert round(server["recompute"]["mean"], 6) == 767.0
    assert round(result["queue_wait_ms"]["l3"], 6) == 2487.0 - 85.0
    text = format_report(result)
    table = text.split("\nITL")[0].splitlines()
    rows = {line.split()[0]: line for line in table if line[:1].isalnum()}
    # source, n, client p50/p95/p99, server p50 (within its buckets) and mean, queue wait
    assert rows["l3"].split() == [
        "l3",
        "4",
        *["2.49", "s"] * 3,
        "75.0",
        "ms",
        "85.0",
        "ms",
        "2.40",
        "s",
    ]
    # 4 x 767 ms in the 0.5-1 s bucket: p50 interpolates to 750 ms; the mean is exact.
    assert rows["recompute"].split()[-6:] == ["750.0", "ms", "767.0", "ms", "0", "ms"]
    assert "client-side (agents)" in text and "server-side" in text
    assert "queue wait: client mean minus server mean" in text
    assert "kvtier serve --max-concurrency" in text


def test_headline_is_like_for_like_and_counts_each_source() -> None:
    result = issue_result()
    c = result["compare"]
    assert (c["n"], c["n_cached"], c["restore_sources"]) == (8, 4, {"l3": 4, "recompute": 4})
    assert round(c["speedup_p50"], 2) == 9.02  # 767 / 85, over the 4 restores from l3 alone
    text = format_report(result)
    assert (
        "8 probes, median 1700 tokens; the session's request: 4 restored from l3, 4 recomputed"
        in text
    )
    assert (
        "from the cache (4 probes): TTFT p50 85.0 ms, recomputed 767.0 ms -> "
        "restore is 9.02x faster"
    ) in text
    assert "left out: 4 probes whose session the server recomputed" in text


def test_summary_reads_in_human_units() -> None:
    text = format_report(issue_result())
    assert "{" not in text and "}" not in text  # no dict repr
    assert "kvtier_tier" not in text and "_total" not in text and "le=" not in text
    assert not WRONG_PLURAL.search(text), WRONG_PLURAL.search(text)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.splitlines()[0] == "19 requests, 18 ok, 1 error (1 http 429); wall 61.2 s"
    assert "  L1 buffers 568.0 KiB of 4.0 MiB (14%), 71 chunks, 6 hits" in text
    assert "  sessions: 0 active, 8 idle, 3 hibernated, 0 pinned" in text
    assert "  restores: 6 from l1, 9 from l2, 0 from l3, 2 recomputed" in text


def test_one_of_each_is_singular() -> None:
    s = Sample(0, 0, 0.0, source="l1", status=200, ttft=0.05, completion_tokens=1)
    pair = {"session": 0, "source": "l1", "restore_s": 0.01, "recompute_s": 0.1,
            "prompt_tokens": 1}  # fmt: skip
    text = format_report(report(LoadConfig(), [s], 1.0, compare_pairs([pair])))
    assert text.startswith("1 request, 1 ok, no errors")
    assert "1 probe, median 1 token; the session's request: 1 restored from l1" in text
    assert not WRONG_PLURAL.search(text), text
    assert "(no server-side figures" in text


def test_no_cached_probe_says_so() -> None:
    pair = {"session": 0, "source": "recompute", "restore_s": 0.1, "recompute_s": 0.1,
            "prompt_tokens": 10}  # fmt: skip
    result = report(LoadConfig(), [], 1.0, compare_pairs([pair]))
    text = format_report(result)
    assert "no probe was served from the cache" in text and "faster" not in text


def test_the_probe_tenants_deletion_is_reported() -> None:
    pair = {"session": 0, "source": "l2", "restore_s": 0.01, "recompute_s": 0.1,
            "prompt_tokens": 10}  # fmt: skip
    compare = compare_pairs([pair, pair])
    compare["probe_tenants"] = {"tenants": 2, "deleted": 2, "chunks": 12, "error": None}
    text = format_report(report(LoadConfig(), [], 1.0, compare))
    assert "  probe tenants deleted after: 2 (12 chunks removed from the cache)" in text
    compare["probe_tenants"] = {
        "tenants": 2, "deleted": 0, "chunks": 0, "error": "DELETE /v1/tenants answered 403"
    }  # fmt: skip
    text = format_report(report(LoadConfig(), [], 1.0, compare))
    assert (
        "  probe tenants left in the cache: 2 of 2 (DELETE /v1/tenants answered 403; an admin "
        "deletes them: DELETE /v1/tenants/{tenant})"
    ) in text
    compare["probe_tenants"] = None  # with an API key: no fresh tenant, nothing to delete
    assert "probe tenants" not in format_report(report(LoadConfig(), [], 1.0, compare))


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "r.png"
    plot(issue_result(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_batch_page_pool_is_reported_by_state() -> None:
    """With paged L1 the sessions' L1 is the batch's parked pages: the report shows the pool
    (from the server's own gauges) beside the tiers."""
    registry = CollectorRegistry()
    ServerMetrics(registry).pages(parked=10, free=4086 - 6, total=4096, page_bytes=8192)
    text = (SCRAPES / "serve-2.txt").read_text() + generate_latest(registry).decode()
    tiers = tiers_now(text)
    assert tiers["pool"] == {"parked": 81920, "running": 6 * 8192, "free": 4080 * 8192}
    result = issue_result()
    result["tiers"] = tiers
    lines = format_report(result).splitlines()
    # the L1 buffers hold the sessions' chunks (71): the pool is not their L1
    pool = next(line for line in lines if line.startswith("  page pool "))
    assert pool == "  page pool  parked 80.0 KiB, running 48.0 KiB, free 31.9 MiB"
    assert "  L1 buffers 568.0 KiB of 4.0 MiB (14%), 71 chunks, 6 hits" in lines
    # paged L1: the L1 buffers hold no chunk, the parked pages are the sessions' L1 and the
    # L1 hits theirs (kvtier plan and kvtop name them so too)
    paged = text.replace('kvtier_tier_chunks{tier="l1"} 71.0', 'kvtier_tier_chunks{tier="l1"} 0.0')
    assert paged != text
    result["tiers"] = tiers_now(paged)
    lines = format_report(result).splitlines()
    assert "  pool (L1)  parked 80.0 KiB, running 48.0 KiB, free 31.9 MiB; 6 hits" in lines
    assert "  L1 buffers 568.0 KiB of 4.0 MiB (14%), 0 chunks" in lines
    assert max(len(line) for line in lines) <= 100
    assert tiers_now((SCRAPES / "serve-2.txt").read_text())["pool"] is None  # no batch pool
