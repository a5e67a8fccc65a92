"""kvtop's view of `kvtier serve`'s batch page pool, and of paged L1, where the pool is L1.

With paged L1 (the server's default) a finished turn's K/V stays in the pool's pages as its
session's L1, and the cache's own L1 tier keeps no copy: its row would read 0 chunks while the
sessions list L1 chunks. kvtop then shows the pool on the L1 row (`PagedL1`). Pure, like the
model: a scrape and the session list in, views out; None where the endpoint has no pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.snapshot import SessionInfo
from ops.kvtop.metrics import Scrape

POOL_STATES = ("parked", "running", "free")


@dataclass(frozen=True)
class PagedL1:
    """The page pool as the sessions' L1: what the L1 row shows with paged L1."""

    used: float  # bytes of pages in use: parked (sessions' L1) and running (turns in flight)
    capacity: float  # bytes of the whole pool
    sessions: int | None  # sessions with chunks in pages; None without a session list
    chunks: int | None  # their chunks in pages (the sessions' L1 column, summed)
    staging: tuple[float | None, float | None]  # the cache's own L1 tier: used, capacity


def pool(cur: Scrape) -> tuple[tuple[str, float], ...]:
    """The batch's page pool in bytes by state, when the endpoint exports it."""
    page = cur.get("kvtier_server_kv_page_bytes")
    if page is None:
        return ()
    return tuple(
        (s, (cur.get("kvtier_server_kv_pages", state=s) or 0.0) * page) for s in POOL_STATES
    )


def paged_l1(cur: Scrape, sessions: tuple[SessionInfo, ...] | None) -> PagedL1 | None:
    """The pool as L1 when L1 is paged: the L1 tier holds no chunk while sessions' chunks sit
    in parked pages (the pool's parked bytes, or the sessions' L1 counts, say so)."""
    by_state = dict(pool(cur))
    if not by_state or cur.get("kvtier_tier_capacity_bytes", tier="l1") is None:
        return None
    in_pages = None if sessions is None else [s.chunks_l1 for s in sessions if s.chunks_l1 > 0]
    if (cur.get("kvtier_tier_chunks", tier="l1") or 0) > 0:
        return None  # the cache's L1 holds the sessions' chunks: L1 buffers, not paged L1
    if by_state["parked"] <= 0 and not in_pages:
        return None  # nothing in L1 either way: the tier's own row says so
    return PagedL1(
        used=by_state["parked"] + by_state["running"],
        capacity=sum(by_state.values()),
        sessions=None if in_pages is None else len(in_pages),
        chunks=None if in_pages is None else sum(in_pages),
        staging=(
            cur.get("kvtier_tier_used_bytes", tier="l1"),
            cur.get("kvtier_tier_capacity_bytes", tier="l1"),
        ),
    )
