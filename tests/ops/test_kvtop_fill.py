"""kvtop on a real server's recordings: the Restore panel's columns say what they count, a tall
terminal's rows carry figures (trends) rather than blank lines, the tiers panel has room for
every line it draws, and with paged L1 the L1 row shows the page pool the sessions' L1 is."""

from __future__ import annotations

import re

import pytest
from test_kvtop_l4 import live_history
from test_kvtop_pool import PAGE, pool_model
from test_kvtop_render import FIX, history, text

from ops.kvtop.metrics import Scrape
from ops.kvtop.model import Model, Options, build, parse_sessions
from ops.kvtop.trends import Trend, chart, trend_lines


def serve_model() -> Model:
    sessions = parse_sessions((FIX / "serve-sessions.json").read_text())
    return build(
        history("serve-1.txt", "serve-2.txt"), sessions, Options(), source="x", interval=1.0
    )


def _row(lines: list[str], name: str) -> list[str]:
    """The cells of the panel row that starts with `name` (another panel may share the line)."""
    for line in lines:
        found = re.search(rf"│ {name} +(.*?)│", line)
        if found:
            return found.group(1).split()
    raise AssertionError(f"no row {name}")


def test_compact_restore_n_counts_what_the_percentiles_come_from() -> None:
    """serve-2 minus serve-1: l2 made 9 restore decisions in all, and its TTFT percentiles
    come from the 4 observations of the last minute; `n` is those 4 in both layouts."""
    model = serve_model()
    l2 = next(r for r in model.restore if r.src == "l2")
    assert (l2.decisions, l2.observed, l2.recent) == (9, 4, True)
    wide = _row(text(model, 200, 60), "l2")
    assert wide[0] == "9" and wide[-1] == "4", wide  # restores ... n
    compact = _row(text(model, 80, 24), "l2")
    assert compact[0] == "4", compact  # not the 9 decisions beside the TTFT percentiles
    assert "restores" in "\n".join(text(model, 200, 60))


def test_a_tall_terminal_charts_trends_instead_of_blank_rows() -> None:
    lines = text(serve_model(), 160, 48)
    assert len(lines) == 48
    blank = sum(
        1 for line in lines for half in (line[:80], line[80:160]) if re.fullmatch(r"│ *│", half)
    )
    assert blank <= 15, "\n".join(lines)  # 50 or so before: the panels' contents were short
    body = "\n".join(lines)
    assert body.count("Trends (last 1m)") == 2  # one under each column
    for name in ("TTFT p50", "restores", "tokens", "L3 reads", "L3 writes"):
        assert f"│ {name} " in body, name
    # every session and every host line still shows
    assert "top 11 of 11" in body and "no host metrics at this endpoint" in body


def test_a_short_terminal_has_no_trends() -> None:
    for size in ((80, 24), (120, 40), (160, 30)):
        assert "Trends" not in "\n".join(text(serve_model(), *size))


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_the_tiers_panel_has_room_for_the_pool_and_counters_lines(size: tuple[int, int]) -> None:
    body = "\n".join(text(pool_model(True), *size))
    assert "page pool parked 80.0K" in body
    assert "shed writes 0" in body  # cut before: the pool line took its row


def paged_model(sessions: bool = True) -> Model:
    """The live recording as a paged-L1 server sees it: the cache's L1 holds no chunk, and 10
    parked pages hold the sessions' L1 (the session list gives 4 sessions, 11 chunks in L1)."""
    h = live_history(l4=False)
    cur = h.latest
    assert cur is not None
    samples = {k: dict(v) for k, v in cur.samples.items()}
    samples["kvtier_tier_chunks"][(("tier", "l1"),)] = 0.0
    samples["kvtier_tier_used_bytes"][(("tier", "l1"),)] = 0.0
    samples["kvtier_server_kv_pages"] = {
        (("state", "parked"),): 10.0,
        (("state", "running"),): 6.0,
        (("state", "free"),): 4080.0,
    }
    samples["kvtier_server_kv_page_bytes"] = {(): PAGE}
    h.add(Scrape(cur.taken_at + 1.0, samples))
    listed = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    return build(h, listed if sessions else None, Options(), source="x", interval=1.0)


def test_paged_l1_shows_the_page_pool_on_the_l1_row() -> None:
    model = paged_model()
    listed = parse_sessions((FIX / "exporter-live-sessions.json").read_text()).sessions
    in_pages = [s.chunks_l1 for s in listed if s.chunks_l1]
    p = model.paged_l1
    assert p is not None and (p.sessions, p.chunks) == (len(in_pages), sum(in_pages))
    assert (p.used, p.capacity) == (16 * PAGE, 4096 * PAGE)
    for size in ((80, 24), (200, 60)):
        lines = text(model, *size)
        l1 = _row(lines, r"pool \(L1\)")
        assert l1[1] == "128K/32.0M" and l1[2] == str(sum(in_pages)), l1  # not 0 chunks
        body = "\n".join(lines)
        assert f"pool (L1), {len(in_pages)} sessions: parked 80.0K" in body
        assert "L1 buffers 0/1.00M" in body  # the cache's own L1 tier: its copy staging
    # No session list: the pool still, its chunks unknown rather than 0.
    bare = paged_model(sessions=False).paged_l1
    assert bare is not None and bare.chunks is None and bare.sessions is None
    # L1 buffers holding the chunks (no paged L1): the tier's own row.
    assert pool_model(True).paged_l1 is None


def test_chart_scales_to_the_highest_value_and_keeps_the_latest() -> None:
    assert chart((0.0, 4.0, 8.0), 4, 2) == ["   █", "  ██"]
    assert chart((1.0, 2.0), 1, 1) == ["█"]  # the oldest point goes first
    assert chart((), 3, 2) == ["   ", "   "]
    assert chart((0.0, 1.0), 2, 1)[0] == " █"
    assert chart((2.0, 8.0), 2, 2) == [" █", "▄█"]  # a quarter of the top: half a row


def test_trend_titles_say_the_latest_and_the_peak() -> None:
    trend = Trend("TTFT p50", "s", (0.5, 0.0, 0.25), None)
    lines = [t.plain for t in trend_lines((trend,), 10, 4)]
    assert lines[0] == "TTFT p50 -  (last 1m, max 500ms)"
    assert len(lines) == 4
    rate = Trend("restores", "/s", (1.0, 2.0), 2.0)
    assert trend_lines((rate,), 10, 3)[0].plain == "restores 2.0/s  (last 1m, max 2.0/s)"
    assert trend_lines((rate,), 10, 1) == []  # no room for a title and a chart row
