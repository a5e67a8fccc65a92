"""Parked pages (`park_pages`): a finished turn's pages stay in the pool as its session's, and
the session's next turn starts from them instead of a copy of its restored prefix.

Tiny transformers models (CPU, float32, random weights), as in test_batching_share: the first
turns run on the scheduler thread, the next ones are driven by hand. Every reply must equal the
session's greedy reply alone; at the end every page is free or parked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_batching import _build, _greedy_alone, _job
from test_batching_share import (
    COMMON,
    FULL,
    _close,
    _conversations,
    _drive,
    _first_turns,
    _next_prompts,
    _reply,
    _restored,
)

from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.turn import Turn
from kvtier.server.devices.model import ServedModel
from kvtier.server.pages.pageshare import page_keys


def _parked_pages(sched: BatchScheduler) -> set[int]:
    return {p for parked in sched.pages.tables.parked.values() for p in parked.table.pages}


def _accounted(sched: BatchScheduler) -> None:
    """Every page is free or held by a parked table, each once (no leak, no double free)."""
    pool = sched.pool
    held = _parked_pages(sched)
    assert pool.num_free + len(held) == pool.num_pages
    assert all(pool.refcount(p) >= 1 for p in held)


def _parked_fleet(
    kind: str, tmp_path: Path, name: str, n: int = 2, **over: Any
) -> tuple[ServedModel, ServedModel, list[list[int]], BatchScheduler, TieredBackend, list[str]]:
    """The reference model, the served one, `n` conversations, and a scheduler (parking on)
    that ran their first turns as sessions `name0`, `name1`, ..."""
    ref = _build(kind)
    served = _build(kind)
    firsts = _conversations(n)
    jobs = [_job(f"{name}{i}", p, 8) for i, p in enumerate(firsts)]
    over.setdefault("paged_l1", False)  # parked pages beside L1 buffers (paged L1 has its file)
    sched, backend, replies = _first_turns(served, tmp_path, jobs, park_pages=True, **over)
    return ref, served, firsts, sched, backend, replies


def _run_recording_starts(sched: BatchScheduler, turns: list[Turn]) -> dict[str, list[int]]:
    """Queue `turns` together and step until they are done; each session's page table as its
    turn was admitted."""
    starts: dict[str, list[int]] = {}

    def hook(step: int) -> None:
        if step == 0:
            sched.waiting.extend(turns)
        for s in turns:
            if s.paged is not None and s.job.session_id not in starts:
                starts[s.job.session_id] = list(s.paged.pages)

    _drive(sched, hook)
    return starts


def _run_alone(sched: BatchScheduler, turn: Turn) -> None:
    """Queue `turn` and step until it is done."""
    _drive(sched, lambda step: sched.waiting.append(turn) if step == 0 else None)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_returning_turn_starts_from_its_parked_pages(kind: str, tmp_path: Path) -> None:
    ref, served, firsts, sched, backend, replies = _parked_fleet(kind, tmp_path, "p", 3)
    loop = asyncio.new_event_loop()
    try:
        assert set(sched.pages.tables.parked) == {("t", f"p{i}") for i in range(3)}
        _accounted(sched)
        tables = {sid: list(p.table.pages) for (_, sid), p in sched.pages.tables.parked.items()}
        nexts = _next_prompts(firsts, replies, 40)
        turns = [_restored(sched, loop, _job(f"p{i}", p, 16)) for i, p in enumerate(nexts)]
        assert all(s.restored is not None and s.restored.source == "l1" for s in turns)
        starts = _run_recording_starts(sched, turns)
        assert sched.pages.parked_turns == 3
        for sid, pages in tables.items():  # each began on its own parked pages
            assert starts[sid][: len(pages)] == pages
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 16)
        assert set(sched.pages.tables.parked) == {("t", f"p{i}") for i in range(3)}  # parked again
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_parked_pages_make_room_least_recent_first(tmp_path: Path) -> None:
    """A pool too small for everyone's parked pages plus a new turn: the least recently parked
    go first; the rest stay and are used."""
    ref = _build("llama")
    served = _build("llama")
    firsts = _conversations(3)
    jobs = [_job(f"r{i}", p, 8) for i, p in enumerate(firsts)]
    # room for about two sessions' parked pages and a running turn, not three
    per_page = 16 * served.model.config.num_hidden_layers * 2 * 2 * 16 * 4
    sched, backend, replies = _first_turns(
        served, tmp_path, jobs[:2], park_pages=True, batch_kv_bytes=26 * per_page, paged_l1=False
    )
    loop = asyncio.new_event_loop()
    try:
        assert sorted(sched.pages.tables.parked) == [("t", "r0"), ("t", "r1")]
        oldest = next(iter(sched.pages.tables.parked))
        newest = list(sched.pages.tables.parked)[-1]
        # a third session's first turn needs more than the free pages: the oldest goes
        third = _restored(sched, loop, jobs[2], check=False)
        _run_alone(sched, third)
        assert _reply(served, third) == _greedy_alone(ref, firsts[2], 8)
        assert oldest not in sched.pages.tables.parked and newest in sched.pages.tables.parked
        _accounted(sched)
        # the newest parked session still starts from its pages
        i = int(newest[1][1:])
        nxt = _next_prompts([firsts[i]], [replies[i]], 41)[0]
        turn = _restored(sched, loop, _job(newest[1], nxt, 8))
        before = sched.pages.parked_turns
        _run_alone(sched, turn)
        assert sched.pages.parked_turns == before + 1
        assert _reply(served, turn) == _greedy_alone(ref, nxt, 8)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_a_turn_restored_from_l2_copies_in_and_frees_the_old_parked_pages(tmp_path: Path) -> None:
    ref, served, firsts, sched, backend, replies = _parked_fleet("qwen2", tmp_path, "h", 2)
    loop = asyncio.new_event_loop()
    try:
        assert backend.hibernate("h0", "t")  # its L1 goes to L2: the parked pages are not it
        nxt = _next_prompts([firsts[0]], [replies[0]], 42)[0]
        turn = _restored(sched, loop, _job("h0", nxt, 16))
        assert turn.restored is not None and turn.restored.source == "l2"
        seen: list[bool] = []

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.append(turn)
            elif turn.paged is not None and not seen:  # admitted: its old pages went
                seen.append(("t", "h0") in sched.pages.tables.parked)

        _drive(sched, hook)
        assert seen == [False]
        assert sched.pages.parked_turns == 0 and turn.trace.copy_in_s > 0  # copied from its Cache
        assert _reply(served, turn) == _greedy_alone(ref, nxt, 16)
        assert ("t", "h0") in sched.pages.tables.parked  # parked again, with this turn's pages
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_a_diverging_turn_reuses_its_pages_and_its_written_pages_lose_their_keys(
    tmp_path: Path,
) -> None:
    """A second turn registers the keys of its whole restored prefix; a third edits the
    conversation just after the common prefix: it restores only up to the edit, starts from
    its parked pages all the same and writes from there, and the index no longer names the
    pages it wrote (another admission would otherwise share K/V of the old tokens)."""
    ref, served, firsts, sched, backend, replies = _parked_fleet("llama", tmp_path, "d", 2)
    loop = asyncio.new_event_loop()
    try:
        second = _next_prompts([firsts[0]], [replies[0]], 43)[0]
        turn = _restored(sched, loop, _job("d0", second, 8))
        _run_alone(sched, turn)
        assert _reply(served, turn) == _greedy_alone(ref, second, 8)
        registered = page_keys("t", second, 16, turn.cached // 16)
        assert (
            len(sched.pages.tables.index().lookup(registered))
            == len(registered)
            > (COMMON + 3) // 16
        )

        edit = COMMON + 3
        third = second[:edit] + [35] * 5 + second[edit + 5 :]
        assert second[edit] != 35
        turn = _restored(sched, loop, _job("d0", third, 12))
        assert turn.cached == edit
        _run_alone(sched, turn)
        assert sched.pages.parked_turns == 2
        assert _reply(served, turn) == _greedy_alone(ref, third, 12)
        # page `edit // 16` on were written: their old keys are gone
        assert len(sched.pages.tables.index().lookup(registered)) <= edit // 16
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_ephemeral_turns_park_nothing(tmp_path: Path) -> None:
    served = _build("llama")
    firsts = _conversations(2)
    jobs = [
        _job("e0", firsts[0], 8, ephemeral=True),
        _job("e1", firsts[1], 8),
    ]
    sched, backend, _ = _first_turns(served, tmp_path, jobs, park_pages=True, paged_l1=False)
    loop = asyncio.new_event_loop()
    try:
        assert list(sched.pages.tables.parked) == [("t", "e1")]
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_parking_off_frees_every_page(tmp_path: Path) -> None:
    served = _build("llama")
    jobs = [_job(f"o{i}", p, 8) for i, p in enumerate(_conversations(2))]
    sched, backend, _ = _first_turns(served, tmp_path, jobs, paged_l1=False)
    loop = asyncio.new_event_loop()
    try:
        assert not sched.pages.tables.parked and sched.pool.num_free == sched.pool.num_pages
    finally:
        _close(sched, backend, loop)


def test_a_turn_that_would_write_a_page_another_table_holds_copies_in_instead(
    tmp_path: Path,
) -> None:
    """Two sessions' second turns share their common prefix's pages, and both park them. The
    first session then edits its conversation inside that prefix: starting from its parked
    pages would write pages the other session's parked table holds, so it copies in instead,
    and the other session's next turn still starts from its own, unchanged pages."""
    ref, served, firsts, sched, backend, replies = _parked_fleet("qwen2", tmp_path, "w", 2)
    loop = asyncio.new_event_loop()
    try:
        seconds = _next_prompts(firsts, replies, 44)
        # w1 restores from L2, so it does not start from its parked pages: it shares w0's
        assert backend.hibernate("w1", "t")
        turns = [_restored(sched, loop, _job(f"w{i}", p, 8)) for i, p in enumerate(seconds)]
        _drive(sched, lambda step: sched.waiting.extend(turns) if step == 0 else None)
        for p, s in zip(seconds, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 8)
        assert sched.pages.shared_pages == FULL  # the second took the first's common pages
        shared = sched.pages.tables.parked[("t", "w0")].table.pages[:FULL]
        assert shared == sched.pages.tables.parked[("t", "w1")].table.pages[:FULL]
        assert all(sched.pool.refcount(p) == 2 for p in shared)

        edit = 40  # inside the common prefix
        third = seconds[0][:edit] + [35] * 5 + seconds[0][edit + 5 :]
        turn = _restored(sched, loop, _job("w0", third, 8), check=False)
        assert turn.cached == edit
        before = sched.pages.parked_turns
        _run_alone(sched, turn)
        assert sched.pages.parked_turns == before  # not from its parked pages
        assert _reply(served, turn) == _greedy_alone(ref, third, 8)

        other = _next_prompts([seconds[1]], [_reply(served, turns[1])], 45)[0]
        turn = _restored(sched, loop, _job("w1", other, 8))
        _run_alone(sched, turn)
        assert sched.pages.parked_turns == before + 1  # from its own parked pages
        assert _reply(served, turn) == _greedy_alone(ref, other, 8)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)
