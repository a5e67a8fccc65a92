"""L1 out of one slab: best-fit ranges that merge when freed, blocks whose range comes back only
when their last view dies, and a fragmented slab that evicts idle sessions instead of asking the
allocator for more memory (CPU here, `reserve(slab=True)`; the cudaMalloc count on CUDA is in
test_cache_gpu.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_cache_exact import config, greedy, reference

from kvtier import TieredCache
from kvtier.errors import L1Fragmented
from kvtier.geometry import KVGeometry
from kvtier.tiers.extents import Extents
from kvtier.tiers.l1 import L1Pool, block_of

G = KVGeometry(3, 2, 8, 8, "float32", "gqa")
CHUNK = 16


def test_extents_best_fit_and_merging() -> None:
    e = Extents(10)
    assert [e.take(2), e.take(3), e.take(1), e.take(4)] == [0, 2, 5, 6]
    assert e.take(1) is None and e.free_units == 0
    e.give(2, 3)
    e.give(6, 4)
    assert e.ranges == [(2, 3), (6, 4)] and e.largest == 4
    assert e.take(3) == 2  # the shortest range that holds it, not the first or the longest
    e.give(0, 2)
    e.give(2, 3)  # merges with the range before it
    assert e.ranges == [(0, 5), (6, 4)]
    e.give(5, 1)  # and with both neighbours
    assert e.ranges == [(0, 10)] and e.largest == 10


def test_extents_refuse_a_range_freed_twice_or_outside() -> None:
    e = Extents(8)
    e.take(4)
    with pytest.raises(ValueError, match="free already"):
        e.give(3, 2)
    with pytest.raises(ValueError, match="outside the slab"):
        e.give(6, 3)
    with pytest.raises(ValueError, match="at least one unit"):
        e.take(0)


def test_a_carved_block_is_the_one_block_layout_and_its_range_returns_after_its_last_view() -> None:
    pool = L1Pool(G, 8 * G.bytes_per_token * CHUNK, "cpu", CHUNK)
    pool.reserve(slab=True)
    assert pool.largest_free_bytes == 8 * pool.unit_bytes
    a = pool.allocate(2 * CHUNK)
    b = pool.allocate(3 * CHUNK)
    block = block_of(a.layers)
    assert block is not None and block is a.block and block.shape == (3, 2, 1, 2, 32, 8)
    for i, (k, v) in enumerate(b.layers):
        k.fill_(i)
        v.fill_(-i)
    for i, (k, v) in enumerate(b.layers):  # a's block is not b's memory
        assert (k == i).all() and (v == -i).all()
    a.block.fill_(7)  # type: ignore[union-attr]
    assert all((k == i).all() for i, (k, _) in enumerate(b.layers))
    assert pool.largest_free_bytes == 3 * pool.unit_bytes

    held = a.layers[1][0][:, :, :5]  # a view someone still holds (a running forward, say)
    where = block.data_ptr()
    del block
    pool.release(a)
    gc.collect()
    assert pool.used_bytes == 3 * pool.unit_bytes  # the budget is given back at once...
    assert pool.largest_free_bytes == 3 * pool.unit_bytes  # ...its memory only when unused
    assert pool.allocate(2 * CHUNK).block.data_ptr() != where  # type: ignore[union-attr]
    assert (held == 7).all()
    del held
    assert pool.allocate(2 * CHUNK).block.data_ptr() == where  # type: ignore[union-attr]


def test_a_fragmented_slab_raises_and_only_the_last_resort_leaves_it() -> None:
    pool = L1Pool(G, 6 * G.bytes_per_token * CHUNK, "cpu", CHUNK)
    pool.reserve(slab=True)
    bufs = [pool.allocate(2 * CHUNK) for _ in range(3)]
    pool.release(bufs[0])
    pool.release(bufs[2])
    bufs[0] = bufs[2] = None  # type: ignore[call-overload]
    gc.collect()
    assert pool.free_bytes == 4 * pool.unit_bytes
    assert pool.largest_free_bytes == 2 * pool.unit_bytes
    with pytest.raises(L1Fragmented, match="no contiguous"):
        pool.allocate(3 * CHUNK)
    assert pool.fragmented == 1 and pool.used_bytes == 2 * pool.unit_bytes  # nothing charged
    with pool.outside_slab():
        extra = pool.allocate(3 * CHUNK)
    assert pool.outside == 1 and extra.block is not None
    assert extra.block.untyped_storage().data_ptr() != bufs[1].block.untyped_storage().data_ptr()  # type: ignore[union-attr]
    small = pool.allocate(CHUNK)  # back in the slab
    assert small.block.untyped_storage().data_ptr() == bufs[1].block.untyped_storage().data_ptr()  # type: ignore[union-attr]


def test_a_fragmented_slab_evicts_idle_sessions_and_the_turns_stay_exact(tmp_path: Path) -> None:
    """Three sessions take 6 chunks of a slab of 8, the middle one hibernates: 4 chunks are
    free, but in two holes of 2. The first session's next turn needs 3 chunks: the cache evicts
    the idle third session (LRU) and carves the block, with no block from outside the slab,
    and every turn's tokens equal a full recompute."""
    model = tiny_llama()
    geometry_bytes = 2 * 2 * 2 * 16 * 4  # tiny_llama: layers x k|v x kv heads x dim x fp32
    cache = TieredCache(config(tmp_path, l1_bytes=8 * 16 * geometry_bytes), model)
    assert cache.l1.unit_bytes == 16 * geometry_bytes
    cache.l1.reserve(slab=True)
    ids: dict[str, torch.Tensor] = {}
    for name, first in (("a", 3), ("b", 4), ("c", 5)):
        ids[name] = torch.tensor([[1] + [first] * 20])  # 21 + 6 generated: 2 chunks
        s = cache.session(name, tenant="t")
        seq, _ = greedy(model, ids[name], s.restore(ids[name]))
        s.commit(seq)
        ids[name] = seq
    cache.session("b", tenant="t").hibernate()
    gc.collect()
    assert cache.l1.largest_free_bytes == 2 * cache.l1.unit_bytes

    evictions = cache.counters.evictions["l1"]
    turn = torch.cat([ids["a"], torch.tensor([[9] * 12])], dim=1)  # 39 + 6: 3 chunks
    s = cache.session("a", tenant="t")
    pkv = s.restore(turn)
    seq, scores = greedy(model, turn, pkv)
    s.commit(seq)
    assert s.restore_source == "l1"
    ref_seq, ref_scores = reference(model, turn)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    assert cache.l1.fragmented >= 1 and cache.l1.outside == 0
    assert cache.counters.evictions["l1"] == evictions + 1
    assert not cache.session("c", tenant="t").resident  # the idle one made room

    for name in ("b", "c"):  # the evicted sessions come back whole
        turn = torch.cat([ids[name], torch.tensor([[2] * 3])], dim=1)
        s = cache.session(name, tenant="t")
        seq, _ = greedy(model, turn, s.restore(turn))
        s.commit(seq)
        assert s.restore_source in ("l2", "l3")
        assert torch.equal(seq, reference(model, turn)[0])
    cache.close()
