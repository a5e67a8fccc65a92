"""Layers across two GPUs: the sharded pool, the placed batch and a failover mid-batch on CUDA.

Run on a machine with two GPUs (`pytest -m gpu tests/kvtier/test_multi_gpu.py`); skipped
elsewhere. The same checks run on two logical CPU devices in test_multi_device.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import _build, _config, _job, _prompts
from test_multi_device import _poison, _turn

from kvtier.geometry import KVGeometry
from kvtier.paged import PagedSequence, PagePool
from kvtier.paged.sharded import ShardedPagePool
from kvtier.placement import Placement
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.devices.failover import DEGRADED, DRAINING, HEALTHY, place
from kvtier.server.devices.model import ServedModel, _wrap, byte_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
]
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _on_gpu(seed: int = 0) -> ServedModel:
    model = _build("llama", seed).model.to(GPU0)
    return _wrap(model, byte_tokenizer(), name=f"test-llama-{seed}")


def _fleet(sched: BatchScheduler, jobs: list[Any], on_delta: Any = None) -> list[Any]:
    async def main() -> list[Any]:
        calls = [_turn(sched, job, on_delta) for job in jobs]
        return list(await asyncio.gather(*calls))

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_sharded_pool_on_two_gpus_equals_one_pool() -> None:
    g = KVGeometry(4, 2, 64, 64, "bfloat16", "gqa")
    budget = 32 * 16 * g.bytes_per_token
    one = PagePool(g, budget, page_size=16, device=GPU0)
    two = ShardedPagePool(g, budget, Placement.balanced(4, [GPU0, GPU1]), page_size=16)
    assert two.shards[1].kv.device == GPU1 and two.layer_cache(3)[0].device == GPU1
    src = torch.randn(4, 2, 100, 2, 64, dtype=torch.bfloat16).pin_memory()
    seqs = []
    for pool in (one, two):
        seq = PagedSequence()
        assert pool.reserve(seq, 100)
        pool.scatter(seq.pages, 0, src, non_blocking=True)
        seq.length = 100
        seqs.append(seq)
    out = torch.empty_like(src).pin_memory()
    two.gather(seqs[1].pages, 0, 100, out=out, non_blocking=True)
    two.synchronize()
    assert torch.equal(out, src)
    assert torch.equal(one.gather(seqs[0].pages, 0, 100).cpu(), src)


def test_two_gpus_reply_as_one(tmp_path: Path) -> None:
    prompts = _prompts(3, [5, 40, 130, 17, 300])
    texts = []
    for n, devices in enumerate(([GPU0], [GPU0, GPU1])):
        served = place(_on_gpu(), devices)
        assert (served.devices is None) == (len(devices) == 1)
        backend = TieredBackend(served.model, _config(tmp_path / str(n)), served.name)
        sched = BatchScheduler(served, backend, _config(tmp_path / str(n)))
        try:
            jobs = [_job(f"s{i}", p, 16) for i, p in enumerate(prompts)]
            texts.append([t for t, _ in _fleet(sched, jobs)])
        finally:
            sched.close()
            backend.close()
    assert texts[0] == texts[1]


def test_fault_on_gpu1_mid_batch_loses_no_session(tmp_path: Path) -> None:
    served = place(_on_gpu(), [GPU0, GPU1])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    prompts = _prompts(11, [5, 60, 130, 17])
    try:
        clean = _fleet(sched, [_job(f"r{i}", p, 24) for i, p in enumerate(prompts)])

        def trigger(text: str) -> None:
            # the first reply text of any session, while every session is still decoding (the
            # bytes a random model picks may decode to no text for a while in one reply)
            if text and failover.state == HEALTHY and not failover.placed._faults:
                poison = lambda: _poison(served, sched, 1)  # noqa: E731
                failover.placed.inject_fault(1, "test fault", before=poison)

        faulted = _fleet(sched, [_job(f"f{i}", p, 24) for i, p in enumerate(prompts)], trigger)
        assert failover.history == [HEALTHY, DRAINING, DEGRADED]
        assert failover.placed.placement.layers == (0, 0)
        for (text, fin), (want, _) in zip(faulted, clean, strict=True):
            assert fin is not None and fin.finish_reason in ("length", "stop")
            assert text == want
        assert failover.restore(1).result(timeout=60)["state"] == HEALTHY
        assert sched.pool.layer_cache(1)[0].device == GPU1
        again = _fleet(sched, [_job(f"g{i}", p, 24) for i, p in enumerate(prompts)])
        assert [t for t, _ in again] == [t for t, _ in clean]
    finally:
        sched.close()
        backend.close()


def test_fault_on_gpu0_the_primary_mid_batch_loses_no_session(tmp_path: Path) -> None:
    """GPU 0 holds the embeddings, the LM head, the batch and the session L1: a fault there
    mid-batch moves all of it to GPU 1 (everything GPU 0 held poisoned: weights, mask, pages,
    L1); the interrupted turns and the next ones equal a healthy server's; restore brings
    GPU 0 back as the primary. Every reference is a fresh session on the healthy server."""
    from test_primary_failover import _poison_primary

    served = place(_on_gpu(), [GPU0, GPU1])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    prompts = _prompts(13, [5, 60, 130, 17])

    def then(ps: list[list[int]], replies: list[Any]) -> list[list[int]]:
        return [p + list(t.encode()) + [10] for p, (t, _) in zip(ps, replies, strict=True)]

    def texts(replies: list[Any]) -> list[str]:
        return [t for t, _ in replies]

    try:
        clean = _fleet(sched, [_job(f"r{i}", p, 24) for i, p in enumerate(prompts)])
        first = _fleet(sched, [_job(f"f{i}", p, 24) for i, p in enumerate(prompts)])
        assert texts(first) == texts(clean)
        seconds = then(prompts, first)
        clean2 = _fleet(sched, [_job(f"q{i}", p, 24) for i, p in enumerate(seconds)])

        def trigger(text: str) -> None:
            if text and failover.state == HEALTHY and not failover.placed._faults:
                poison = lambda: _poison_primary(served, sched, backend)  # noqa: E731
                failover.placed.inject_fault(0, "test fault", before=poison)

        faulted = _fleet(sched, [_job(f"f{i}", p, 24) for i, p in enumerate(seconds)], trigger)
        assert failover.history == [HEALTHY, DRAINING, DEGRADED]
        assert failover.placed.placement.layers == (1, 1)
        assert served.device == GPU1 and served.model.lm_head.weight.device == GPU1
        assert sched.pool.device == GPU1 and backend.cache.device == GPU1
        assert served.allowed is None or served.allowed.device == GPU1
        for (text, fin), (want, _) in zip(faulted, clean2, strict=True):
            assert fin is not None and fin.finish_reason in ("length", "stop")
            assert text == want
        thirds = then(seconds, faulted)
        degraded = _fleet(sched, [_job(f"f{i}", p, 16) for i, p in enumerate(thirds)])
        assert all(fin is not None and fin.cached_tokens > 0 for _, fin in degraded)

        assert failover.restore(0).result(timeout=60)["state"] == HEALTHY
        assert failover.placed.placement.layers == (0, 1)
        assert served.device == GPU0 and sched.pool.device == GPU0
        assert backend.cache.device == GPU0 and sched.pool.layer_cache(1)[0].device == GPU1
        clean3 = _fleet(sched, [_job(f"t{i}", p, 16) for i, p in enumerate(thirds)])
        assert texts(degraded) == texts(clean3)
        fourths = then(thirds, degraded)
        last = _fleet(sched, [_job(f"f{i}", p, 16) for i, p in enumerate(fourths)])
        assert all(fin is not None and fin.cached_tokens > 0 for _, fin in last)
        clean4 = _fleet(sched, [_job(f"u{i}", p, 16) for i, p in enumerate(fourths)])
        assert texts(last) == texts(clean4)
    finally:
        sched.close()
        backend.close()
