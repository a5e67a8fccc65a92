"""kvtop's batch-pool line: `kvtier serve`'s page pool by state (with paged L1, the default, its
parked pages are the sessions' L1, which the L1 tier row no longer counts), hidden at an
endpoint that has no batch."""

from __future__ import annotations

import pytest
from test_kvtop_l4 import live_history
from test_kvtop_render import FIX, text

from ops.kvtop.metrics import Scrape
from ops.kvtop.model import Model, Options, build, parse_sessions

PAGE = 8192.0


def pool_model(pool: bool) -> Model:
    src = live_history(l4=False)
    cur = src.latest
    assert cur is not None
    samples = {k: dict(v) for k, v in cur.samples.items()}
    if pool:
        samples["kvtier_server_kv_pages"] = {
            (("state", "parked"),): 10.0,
            (("state", "running"),): 6.0,
            (("state", "free"),): 4080.0,
        }
        samples["kvtier_server_kv_page_bytes"] = {(): PAGE}
    src.add(Scrape(cur.taken_at + 1.0, samples))
    sessions = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    return build(src, sessions, Options(), source="x", interval=1.0)


def test_pool_figures_by_state() -> None:
    assert pool_model(True).pool == (
        ("parked", 10 * PAGE),
        ("running", 6 * PAGE),
        ("free", 4080 * PAGE),
    )
    assert pool_model(False).pool == ()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_pool_line_shows_and_hides(size: tuple[int, int]) -> None:
    body = "\n".join(text(pool_model(True), *size))
    assert "page pool parked 80.0K" in body, body
    assert "page pool" not in "\n".join(text(pool_model(False), *size))
