"""Paged L1 (`paged_l1`): the batch's page pool is the sessions' L1. A finished turn stores its
new chunks in L2 straight from its pages and parks them; the tiered cache keeps no L1 copy; the
next turn starts from the parked pages, or restores from L2/L3 once they went.

Tiny transformers models (CPU, float32, random weights), as in test_batching_park: the first
turns run on the scheduler thread, the next ones are driven by hand. Every reply must equal the
session's greedy reply alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import pytest
import torch
from test_batching import _build, _greedy_alone, _job
from test_batching_park import _accounted, _parked_fleet, _run_alone, _run_recording_starts
from test_batching_share import (
    _close,
    _conversations,
    _drive,
    _first_turns,
    _next_prompts,
    _reply,
    _restored,
)

from kvtier.cache.restore import StagedPrefix
from kvtier.errors import KvtierError
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.devices.memplan import PAGE_SIZE
from kvtier.types import SessionState


def _no_l1(backend: TieredBackend) -> None:
    """The cache holds no session in L1: each is idle in its pages, or hibernated."""
    cache = backend.cache
    assert cache.l1.used_bytes == 0
    for s in cache.sessions():
        assert not s.resident
        assert (s.state, s.in_pages) in (
            (SessionState.IDLE, True),
            (SessionState.HIBERNATED, False),
        )


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_turns_start_from_their_pages_and_the_cache_keeps_no_l1_copy(
    kind: str, tmp_path: Path
) -> None:
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        kind, tmp_path, "g", 3, paged_l1=True
    )
    loop = asyncio.new_event_loop()
    try:
        assert sched.paged_l1
        _no_l1(backend)
        _accounted(sched)
        tables = {sid: list(p.table.pages) for (_, sid), p in sched.pages.tables.parked.items()}
        nexts = _next_prompts(firsts, replies, 50)
        turns = [_restored(sched, loop, _job(f"g{i}", p, 16)) for i, p in enumerate(nexts)]
        assert all(s.restored is not None and s.restored.source == "l1" for s in turns)
        assert all(s.restored is not None and s.restored.kv is None for s in turns)  # no copy
        assert backend.cache.l1.used_bytes == 0
        starts = _run_recording_starts(sched, turns)
        assert sched.pages.parked_turns == 3
        for s in turns:  # each began on its own parked pages, as far as its prefix reaches
            sid = s.job.session_id
            kept = sched.pool.pages_for(s.cached)
            assert starts[sid][:kept] == tables[sid][:kept]
            assert s.trace.copy_in_s == 0
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 16)
        _no_l1(backend)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_once_its_pages_went_a_turn_restores_from_l2_and_after_a_restart_from_l3(
    tmp_path: Path,
) -> None:
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        "qwen2", tmp_path, "r", 2, paged_l1=True
    )
    loop = asyncio.new_event_loop()
    try:
        sessions = [backend.cache.session(f"r{i}", "t") for i in range(2)]
        assert all(s.state is SessionState.IDLE and s.in_pages for s in sessions)
        every = sched.pool.num_pages - sched.pool.num_free
        assert sched.pages.make_room(every, sched.waiting)  # every page goes
        assert not sched.pages.tables.parked
        sched.report_dropped()  # as the scheduler's iteration does after scheduling
        sched.commits.executor.submit(lambda: None).result()  # the cache hears of it there
        assert all(s.state is SessionState.HIBERNATED and not s.in_pages for s in sessions)
        second = _next_prompts([firsts[0]], [replies[0]], 51)[0]
        turn = _restored(sched, loop, _job("r0", second, 12))
        assert turn.restored is not None and turn.restored.source == "l2"
        assert turn.cached == len(firsts[0]) + len(replies[0].encode()) - 1  # every fed token
        # staged: the prefix waits in its pinned L2 slots, and L1 is never touched ...
        staged = turn.restored.kv
        assert isinstance(staged, StagedPrefix) and staged.tokens == turn.cached
        assert sessions[0].staged is staged and all(e.pins == 1 for e in staged.chunks)
        assert backend.cache.l1.used_bytes == 0 and not turn.holds_l1
        unpinned: list[bool] = []

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.append(turn)
            elif turn.paged is not None and not unpinned:  # ... until its pages take it
                sched.commits.executor.submit(lambda: None).result()
                unpinned.append(
                    sessions[0].staged is None and not any(e.pins for e in staged.chunks)
                )

        _drive(sched, hook)
        assert unpinned == [True] and turn.restored.kv is None
        assert backend.cache.l1.used_bytes == 0
        second_reply = _reply(served, turn)
        assert second_reply == _greedy_alone(ref, second, 12)
        _no_l1(backend)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)
    # a new process over the same L3: the third turn comes back from disk
    config = sched.config
    backend = TieredBackend(served.model, config, served.name)
    sched = BatchScheduler(served, backend, config)
    sched.close()
    sched.commits.executor = concurrent.futures.ThreadPoolExecutor(1)  # finished turns commit here
    sched.pages.loader.executor = concurrent.futures.ThreadPoolExecutor(
        1
    )  # staged prefixes load here
    loop = asyncio.new_event_loop()
    try:
        third = _next_prompts([second], [second_reply], 52)[0]
        turn = _restored(sched, loop, _job("r0", third, 8))
        assert turn.restored is not None and turn.restored.source == "l3"
        _run_alone(sched, turn)
        assert _reply(served, turn) == _greedy_alone(ref, third, 8)
    finally:
        _close(sched, backend, loop)


def test_a_preempted_turn_keeps_its_kv_beside_the_pool(tmp_path: Path) -> None:
    """A pool too small for three decoding sessions: the latest is preempted; with no Cache to
    take its K/V, it waits beside the pool and is written back when admitted again."""
    page_bytes = 2 * 2 * 2 * 16 * 4 * PAGE_SIZE  # layers * k|v * kv heads * dim * fp32 * tokens
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        "llama", tmp_path, "v", 3, paged_l1=True, batch_kv_bytes=19 * page_bytes
    )
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 53)
        turns = [_restored(sched, loop, _job(f"v{i}", p, 40)) for i, p in enumerate(nexts)]
        before = sched.pages.preemptions
        _drive(sched, lambda step: sched.waiting.extend(turns) if step == 0 else None)
        assert sched.pages.preemptions > before
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 40)
            assert s.spilled is None
        _no_l1(backend)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


def test_an_edited_conversation_takes_only_the_common_part_of_its_pages(tmp_path: Path) -> None:
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        "llama", tmp_path, "e", 1, paged_l1=True
    )
    loop = asyncio.new_event_loop()
    try:
        second = _next_prompts(firsts, replies, 54)[0]
        edit = 37
        second = second[:edit] + [35] * 4 + second[edit + 4 :]
        assert firsts[0][edit] != 35
        turn = _restored(sched, loop, _job("e0", second, 10), check=False)
        assert turn.restored is not None and turn.restored.source == "l1"
        assert turn.cached == edit
        _run_alone(sched, turn)
        assert sched.pages.parked_turns == 1
        assert _reply(served, turn) == _greedy_alone(ref, second, 10)
        _no_l1(backend)
        _accounted(sched)
    finally:
        _close(sched, backend, loop)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_pages_through_l2_and_back_are_bit_identical(device: str, tmp_path: Path) -> None:
    """A turn's pages go to L2 at its commit (straight from the pages) and, once the pool let
    them go, come back through a restore: the K/V in the new pages equals the old bit for bit
    (bfloat16 on CUDA, float32 on the CPU)."""
    served = _build("qwen2")
    if device == "cuda":
        served.model.to("cuda", torch.bfloat16)
        if served.allowed is not None:
            served.allowed = served.allowed.to("cuda")
    firsts = _conversations(2)
    jobs = [_job(f"b{i}", p, 8) for i, p in enumerate(firsts)]
    sched, backend, replies = _first_turns(served, tmp_path, jobs, paged_l1=True)
    loop = asyncio.new_event_loop()
    try:
        parked = sched.pages.tables.parked[("t", "b0")].table
        before = sched.pool.gather(parked.pages, 0, parked.length).clone()
        assert sched.pages.make_room(sched.pool.num_pages - sched.pool.num_free, sched.waiting)
        second = _next_prompts([firsts[0]], [replies[0]], 55)[0]
        turn = _restored(sched, loop, _job("b0", second, 4))
        assert turn.restored is not None and turn.restored.source == "l2"
        assert turn.cached == before.shape[2]  # every token the parked pages held
        _run_alone(sched, turn)
        _reply(served, turn)
        again = sched.pages.tables.parked[("t", "b0")].table
        after = sched.pool.gather(again.pages, 0, turn.cached)
        assert after.dtype == before.dtype and torch.equal(after, before)
    finally:
        _close(sched, backend, loop)


def test_a_turn_that_fails_before_admission_lets_its_claimed_pages_go(tmp_path: Path) -> None:
    """A turn that claimed its session's parked pages and then fails while it waits (here: a
    client gone) gives the claim back: the pages can make room again, and the session's next
    turn starts from them."""
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        "llama", tmp_path, "f", 1, paged_l1=True
    )
    loop = asyncio.new_event_loop()
    try:
        second = _next_prompts(firsts, replies, 56)[0]
        turn = _restored(sched, loop, _job("f0", second, 6))
        parked = sched.pages.tables.parked[("t", "f0")]
        assert parked.claimed and turn.held is parked
        assert not sched.pages.make_room(1, sched.waiting)  # claimed: nothing to free
        sched.waiting.append(turn)
        sched.fail(turn, KvtierError("the client went away"))
        assert turn.done.result(60) is None  # failed and aborted
        assert not parked.claimed and turn.held is None
        again = _restored(sched, loop, _job("f0", second, 6))
        assert again.restored is not None and again.restored.source == "l1"
        _run_alone(sched, again)
        assert sched.pages.parked_turns == 1
        assert _reply(served, again) == _greedy_alone(ref, second, 6)
        _no_l1(backend)
    finally:
        _close(sched, backend, loop)


def test_a_staged_prefix_that_never_reaches_its_pages_fails_its_turn_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """The loader cannot copy a turn's staged prefix (here: it was let go before the turn
    was admitted, so the cache refuses it): the turn fails with that error, nothing of its
    pages is committed, and the session's next turn restores the same stored prefix."""
    ref, served, firsts, sched, backend, replies = _parked_fleet(
        "llama", tmp_path, "x", 1, paged_l1=True
    )
    loop = asyncio.new_event_loop()
    try:
        assert sched.pages.make_room(sched.pool.num_pages - sched.pool.num_free, sched.waiting)
        sched.commits.executor.submit(lambda: None).result()  # the session is in L2/L3 alone now
        second = _next_prompts(firsts, replies, 57)[0]
        turn = _restored(sched, loop, _job("x0", second, 6))
        staged = turn.restored.kv if turn.restored is not None else None
        assert isinstance(staged, StagedPrefix)
        backend.release_staged("x0", "t", staged)  # its pins go: the cache refuses to load it
        _run_alone(sched, turn)
        assert turn.done.result(60) is None and turn.paged is None
        assert sched.pool.num_free == sched.pool.num_pages  # its pages went back
        session = backend.cache.session("x0", "t")
        assert session.state is SessionState.HIBERNATED and session.staged is None
        assert not any(e.pins for e in backend.cache.directory.entries.values())
        again = _restored(sched, loop, _job("x0", second, 6))
        assert again.restored is not None and again.restored.source == "l2"
        assert again.cached == turn.cached  # the stored prefix is whole
        _run_alone(sched, again)
        assert _reply(served, again) == _greedy_alone(ref, second, 6)
    finally:
        _close(sched, backend, loop)
