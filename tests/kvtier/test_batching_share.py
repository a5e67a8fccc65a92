"""Sessions of one tenant whose restored prefixes start alike share those full KV pages.

The batch scheduler admits a turn by copying its restored prefix's K/V into pages; a running
turn of the same tenant that holds the same leading tokens lends its full pages instead
(`PagePool.share`). Tiny transformers models (CPU, float32, random weights): every reply must
equal the session's greedy reply alone, and every page must be free at the end. The scheduler
thread is stopped after the first turns, and the tests drive `_schedule`/`_step` by hand, so
which turn holds and which shares is fixed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import _build, _config, _greedy_alone, _job, _one, _prompts, _run
from test_multi_device import _poison

from kvtier.paged.sharded import ShardedPagePool
from kvtier.server.backend import RecomputeBackend, TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Job, Stream
from kvtier.server.batch.turn import Turn
from kvtier.server.decoding.sampling import ReplyText, make_generator
from kvtier.server.devices.failover import DEGRADED, place
from kvtier.server.devices.memplan import PAGE_SIZE
from kvtier.server.devices.model import ServedModel

COMMON = 100  # tokens every session's conversation starts with: 6 full pages of 16
FULL = COMMON // PAGE_SIZE


def _first_turns(
    served: ServedModel, tmp_path: Path, jobs: list[Job], **over: Any
) -> tuple[BatchScheduler, TieredBackend, list[str]]:
    """Run each session's first turn through the scheduler thread (the backend commits it),
    then stop the thread: the caller drives the next turns by hand."""
    over.setdefault("paged_l1", False)  # turns leave the pool when they end (no parking)
    config = _config(tmp_path, **over)
    backend = TieredBackend(served.model, config, served.name)
    sched = BatchScheduler(served, backend, config)
    results = _run(sched, *(_one(sched, job) for job in jobs))
    sched.close()
    sched.commits.executor = concurrent.futures.ThreadPoolExecutor(1)  # finished turns commit here
    sched.pages.loader.executor = concurrent.futures.ThreadPoolExecutor(
        1
    )  # staged prefixes load here
    return sched, backend, [r.text for r in results]


def _restored(
    sched: BatchScheduler, loop: asyncio.AbstractEventLoop, job: Job, check: bool = True
) -> Turn:
    """A turn restored from the backend (on this thread), ready to queue; `check`: it restores
    at least the common prefix (a committed earlier turn)."""
    s = Turn(
        job=job,
        stream=Stream(loop),
        admitted=0.0,
        done=concurrent.futures.Future(),
        reply=ReplyText(sched.served.tokenizer, sched.served.eos_ids, job.stop),
        gen=make_generator(job.temperature, job.seed),
        tokens=list(job.prompt_ids),
    )
    sched.restores.restore(s)
    sched.queues.arrived.remove(s)
    assert not check or s.cached >= COMMON, "the next turn restores the committed first turn"
    return s


def _drive(sched: BatchScheduler, hook: Callable[[int], None]) -> None:
    """Step until nothing waits or runs; `hook(step)` runs before each step (to queue turns)
    and once after the last."""
    for step in range(2000):
        hook(step)
        if not (sched.running or sched.waiting):
            return
        items = sched.schedule()
        if items:
            sched.run_step(items)
        else:  # as the scheduler's thread does
            sched._drain()
            sched.pages.wait_loading(sched.running)
        sched._deliver()
    raise AssertionError("the turns did not finish")


def _reply(served: ServedModel, s: Turn) -> str:
    s.done.result(60)  # committed
    return bytes(t for t in s.reply.ids if t not in served.eos_ids).decode()


def _next_prompts(firsts: list[list[int]], replies: list[str], seed: int) -> list[list[int]]:
    tails = _prompts(seed, [12] * len(firsts))
    return [p + list(r.encode()) + t for p, r, t in zip(firsts, replies, tails, strict=True)]


def _conversations(n: int) -> list[list[int]]:
    common = _prompts(30, [COMMON])[0]
    return [common + tail for tail in _prompts(31, [20 + 15 * i for i in range(n)])]


def _close(sched: BatchScheduler, backend: TieredBackend, loop: asyncio.AbstractEventLoop) -> None:
    sched.commits.executor.shutdown(wait=True)
    sched.pages.loader.executor.shutdown(wait=True)
    backend.close()
    loop.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-on-2-devices"])
def test_one_tenants_sessions_share_their_common_prefix_pages(kind: str, tmp_path: Path) -> None:
    ref = _build(kind.split("-")[0])
    served = _build(kind.split("-")[0])
    if kind.endswith("devices"):  # two logical devices on the CPU: a pool sharded by layer
        served = place(served, [torch.device("cpu")] * 2)
    firsts = _conversations(3)
    jobs = [_job(f"s{i}", p, 8) for i, p in enumerate(firsts)]
    sched, backend, replies = _first_turns(served, tmp_path, jobs)
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 32)
        turns = [_restored(sched, loop, _job(f"s{i}", p, 16)) for i, p in enumerate(nexts)]
        pool = sched.pool
        assert isinstance(pool, ShardedPagePool) == kind.endswith("devices")
        seen: dict[str, Any] = {"refs": 0, "used": 0, "tables": 0}

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend(turns)
            if len(sched.running) == 3:
                refs = min(pool.refcount(p) for s in turns for p in s.paged.pages[:FULL])
                seen["refs"] = max(seen["refs"], refs)
                seen["used"] = pool.num_pages - pool.num_free
                seen["tables"] = sum(len(s.paged.pages) for s in turns if s.paged)

        _drive(sched, hook)
        # The three held the common prefix's full pages once, with three references each.
        assert seen["refs"] == 3
        assert sched.pages.shared_pages == 2 * FULL
        assert seen["used"] == seen["tables"] - 2 * FULL  # fewer pages than three copies
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 16)
        assert pool.num_free == pool.num_pages
        assert len(sched.pages.tables.prefixes) == 0  # the index forgot the turns that left
    finally:
        _close(sched, backend, loop)


def test_sessions_of_different_tenants_never_share_a_page(tmp_path: Path) -> None:
    ref = _build("llama")
    served = _build("llama")
    firsts = _conversations(3)
    tenants = ["t", "t", "u"]
    jobs = [
        Job(session_id=f"{t}{i}", tenant=t, prompt_ids=p, max_tokens=8, temperature=0.0)
        for i, (t, p) in enumerate(zip(tenants, firsts, strict=True))
    ]
    sched, backend, replies = _first_turns(served, tmp_path, jobs)
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 33)
        turns = [
            _restored(sched, loop, dataclasses.replace(j, prompt_ids=p, max_tokens=16))
            for j, p in zip(jobs, nexts, strict=True)
        ]
        pool = sched.pool
        refs: list[list[int]] = []

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend(turns)
            if len(sched.running) == 3:
                refs.append([max(pool.refcount(p) for p in s.paged.pages[:FULL]) for s in turns])

        _drive(sched, hook)
        assert refs and all(r == [2, 2, 1] for r in refs)  # tenant u's pages are its own
        assert sched.pages.shared_pages == FULL  # t1 shared t0's pages; u2 shared none
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 16)
        assert pool.num_free == pool.num_pages
    finally:
        _close(sched, backend, loop)


def test_a_holder_leaving_first_leaves_the_sharers_pages(tmp_path: Path) -> None:
    """The turn whose pages were shared finishes first: its sharer keeps them (and still
    replies exactly); a third turn joining afterwards shares them from the sharer."""
    ref = _build("llama")
    served = _build("llama")
    firsts = _conversations(3)
    jobs = [_job(f"h{i}", p, 8) for i, p in enumerate(firsts)]
    sched, backend, replies = _first_turns(served, tmp_path, jobs)
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 34)
        lengths = [3, 30, 10]  # the holder ends first
        holder, sharer, late = (
            _restored(sched, loop, _job(f"h{i}", p, n))
            for i, (p, n) in enumerate(zip(nexts, lengths, strict=True))
        )
        pool = sched.pool
        common: list[int] = []
        joined = [False]

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.append(holder)
            elif step == 1:
                assert holder.paged is not None  # it runs
                common.extend(holder.paged.pages[:FULL])
                sched.waiting.append(sharer)
            elif step == 2:
                assert sharer.paged is not None and holder.paged is not None
                assert sharer.paged.pages[:FULL] == common  # taken from the holder
            if holder.gone and not joined[0]:  # it left the scheduler (its commit may still run)
                assert sharer in sched.running
                assert [pool.refcount(p) for p in common] == [1] * FULL  # the sharer's alone
                sched.waiting.append(late)
                joined[0] = True

        _drive(sched, hook)
        assert joined[0]
        assert sched.pages.shared_pages == 2 * FULL  # the sharer's and the late turn's
        for p, n, s in zip(nexts, lengths, (holder, sharer, late), strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, n)
        assert pool.num_free == pool.num_pages
        assert len(sched.pages.tables.prefixes) == 0
    finally:
        _close(sched, backend, loop)


def test_shared_pages_survive_preemption_in_a_full_pool(tmp_path: Path) -> None:
    """A pool too small for three decoding sessions: the latest is preempted (it drops its
    references; the others keep the shared pages) and, admitted again, shares them again."""
    ref = _build("llama")
    served = _build("llama")
    page_bytes = 2 * 2 * 2 * 16 * 4 * PAGE_SIZE  # layers * k|v * kv heads * dim * fp32 * tokens
    firsts = _conversations(3)
    jobs = [_job(f"p{i}", p, 8) for i, p in enumerate(firsts)]
    sched, backend, replies = _first_turns(served, tmp_path, jobs, batch_kv_bytes=19 * page_bytes)
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 35)
        turns = [_restored(sched, loop, _job(f"p{i}", p, 40)) for i, p in enumerate(nexts)]
        before = sched.pages.preemptions

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend(turns)

        _drive(sched, hook)
        assert sched.pages.preemptions > before  # the decoders outgrew the pool
        assert sched.pages.shared_pages >= 3 * FULL  # the preempted turn shared again on return
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 40)
        assert sched.pool.num_free == sched.pool.num_pages
        assert len(sched.pages.tables.prefixes) == 0
    finally:
        _close(sched, backend, loop)


def test_no_sharing_with_a_lossy_codec(tmp_path: Path) -> None:
    """With int8 or fp8 chunks in L2/L3 a restored prefix may be approximate: a session whose
    prefix is exact (from L1) must not read another session's pages of it."""
    served = _build("llama")
    for codec, shares in (("native", True), ("int8", False), ("fp8", False)):
        sched = BatchScheduler(
            served, RecomputeBackend(served.model), _config(tmp_path, codec=codec)
        )
        sched.close()
        assert sched.pages.tables.share_prefixes is shares


def test_a_device_lost_while_pages_are_shared(tmp_path: Path) -> None:
    """Two logical devices; device 1 is lost while three turns share their prefix pages: the
    pages go with the old pool (poisoned), the turns are admitted into the rebuilt pool, share
    there again, and reply exactly."""
    ref = _build("llama")
    served = place(_build("llama"), [torch.device("cpu")] * 2)
    failover = served.devices
    firsts = _conversations(3)
    jobs = [_job(f"f{i}", p, 8) for i, p in enumerate(firsts)]
    sched, backend, replies = _first_turns(served, tmp_path, jobs)
    loop = asyncio.new_event_loop()
    try:
        nexts = _next_prompts(firsts, replies, 36)
        turns = [_restored(sched, loop, _job(f"f{i}", p, 16)) for i, p in enumerate(nexts)]
        old = sched.pool
        shared_before: list[int] = []

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend(turns)
            elif step == 3:
                assert len(sched.running) == 3 and sched.pages.shared_pages == 2 * FULL
                shared_before.append(sched.pages.shared_pages)
                _poison(served, sched, 1)  # what the lost device's pages are worth
                done = failover.fail(1)
                failover.poll(sched)  # as the scheduler does between steps
                assert done.result(5)["state"] == DEGRADED
                assert sched.pool is not old and not sched.running  # all wait to run again

        _drive(sched, hook)
        assert shared_before and sched.pages.shared_pages == 4 * FULL  # shared again after it
        for p, s in zip(nexts, turns, strict=True):
            assert _reply(served, s) == _greedy_alone(ref, p, 16)
        assert sched.pool.num_free == sched.pool.num_pages
    finally:
        _close(sched, backend, loop)
