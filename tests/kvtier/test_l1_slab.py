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
from kvtier.codecs import make_codec
from kvtier.errors import L1Fragmented
from kvtier.geometry import KVGeometry
from kvtier.tiers.extents import Extents
from kvtier.tiers.l1 import L1Pool, block_of
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine

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
    chunk = pool.bytes_for(CHUNK)  # every layer's K and V: 6 slab units
    assert chunk == 6 * pool.unit_bytes and pool.largest_free_bytes == 8 * chunk
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
    assert pool.largest_free_bytes == 3 * chunk

    held = a.layers[1][0][:, :, :5]  # a view someone still holds (a running forward, say)
    where = block.data_ptr()
    del block
    pool.release(a)
    gc.collect()
    assert pool.used_bytes == 3 * chunk  # the budget is given back at once...
    assert pool.largest_free_bytes == 3 * chunk  # ...its memory only when unused
    assert pool.allocate(2 * CHUNK).block.data_ptr() != where  # type: ignore[union-attr]
    assert (held == 7).all()
    del held
    assert pool.allocate(2 * CHUNK).block.data_ptr() == where  # type: ignore[union-attr]


def test_no_range_long_enough_gives_per_layer_pieces_from_the_holes() -> None:
    """Two holes of 2 chunks and a 3-chunk session: no block fits, its 6 layer planes do (3
    units each, 12 units per hole); the engine moves that layout bit for bit."""
    pool = L1Pool(G, 6 * G.bytes_per_token * CHUNK, "cpu", CHUNK)
    pool.reserve(slab=True)
    sessions = [pool.allocate(2 * CHUNK) for _ in range(3)]
    pool.release(sessions[0])
    pool.release(sessions[2])
    del sessions[2], sessions[0]
    gc.collect()
    assert pool.largest_free_bytes == 2 * pool.bytes_for(CHUNK)
    bufs = pool.allocate(3 * CHUNK)
    assert pool.split_allocations == 1 and pool.fragmented == 0 and pool.outside == 0
    assert bufs.block is None and bufs.layers[0][0].shape == (1, 2, 48, 8)
    slab = sessions[0].block.untyped_storage().data_ptr()  # type: ignore[union-attr]
    assert all(t.untyped_storage().data_ptr() == slab for pair in bufs.layers for t in pair)
    codec = make_codec("native", G)
    arena = HostArena(codec.payload_bytes(CHUNK), 8 * codec.payload_bytes(CHUNK), pin=None)
    engine = TransferEngine(G, CHUNK, "cpu", arena, None, codec)
    for k, v in bufs.layers:
        k.normal_()
        v.normal_()
    slots = [arena.alloc() for _ in range(3)]
    engine.offload_range(bufs.layers, 0, 3 * CHUNK, slots).wait()  # type: ignore[arg-type]
    expect = [(k.clone(), v.clone()) for k, v in bufs.layers]
    pool.release(sessions[0])
    pool.release(bufs)
    del sessions[0], bufs
    gc.collect()
    again = pool.allocate(3 * CHUNK)  # the pieces' ranges merged back: one block again
    assert again.block is not None
    engine.restore_range(slots, 3 * CHUNK, again.layers, 0, block=again.block).wait()  # type: ignore[arg-type]
    for (k, v), (k2, v2) in zip(expect, again.layers, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    engine.close()
    arena.close()


def test_holes_smaller_than_a_piece_raise_and_only_the_last_resort_leaves_the_slab() -> None:
    one = KVGeometry(1, 2, 8, 8, "float32", "gqa")  # 2 units per chunk
    pool = L1Pool(one, 8 * one.bytes_per_token * CHUNK, "cpu", CHUNK)
    pool.reserve(slab=True)
    sessions = [pool.allocate(CHUNK) for _ in range(8)]
    for i in (0, 2, 4, 6):
        pool.release(sessions[i])
        sessions[i] = None  # type: ignore[call-overload]
    gc.collect()
    assert pool.free_bytes == 4 * pool.bytes_for(CHUNK)
    assert pool.largest_free_bytes == 2 * pool.unit_bytes
    with pytest.raises(L1Fragmented, match="not in ranges"):
        pool.allocate(3 * CHUNK)  # neither 6 units in a row nor a hole of 3 for each plane
    assert pool.fragmented == 1 and pool.used_bytes == 4 * pool.bytes_for(CHUNK)  # no charge
    assert pool.largest_free_bytes == 2 * pool.unit_bytes  # the pieces taken were given back
    with pool.outside_slab():
        extra = pool.allocate(3 * CHUNK)
    assert pool.outside == 1 and extra.block is not None
    assert (
        extra.block.untyped_storage().data_ptr() != sessions[1].block.untyped_storage().data_ptr()
    )  # type: ignore[union-attr]


def test_a_fragmented_slab_evicts_an_idle_session_and_the_turns_stay_exact(
    tmp_path: Path,
) -> None:
    """A one-layer model (2 slab units per chunk): eight 1-chunk sessions fill a slab of 8
    chunks, every other one hibernates: 4 chunks are free, in holes of 2 units. The first
    session's next turn needs 3 chunks: no range of 6 units, and no hole of 3 for each plane,
    so the cache evicts the idle session next to the holes' (LRU) and carves one block; no
    block comes from outside the slab, and every turn's tokens equal a full recompute."""
    model = tiny_llama(layers=1)
    per_chunk = 16 * 2 * 2 * 16 * 4  # tokens x k|v x kv heads x head dim x fp32, one layer
    cache = TieredCache(config(tmp_path, l1_bytes=8 * per_chunk), model)
    cache.l1.reserve(slab=True)
    assert cache.l1.bytes_for(CHUNK) == per_chunk
    ids: dict[str, torch.Tensor] = {}
    for i in range(8):
        name = f"s{i}"
        ids[name] = torch.tensor([[1] + [3 + i] * 8])  # 9 + 6 generated: 1 chunk
        s = cache.session(name, tenant="t")
        seq, _ = greedy(model, ids[name], s.restore(ids[name]))
        s.commit(seq)
        ids[name] = seq
    for i in (1, 3, 5, 7):
        cache.session(f"s{i}", tenant="t").hibernate()
    gc.collect()
    assert cache.l1.largest_free_bytes == 2 * cache.l1.unit_bytes

    evictions = cache.counters.evictions["l1"]
    turn = torch.cat([ids["s0"], torch.tensor([[9] * 20])], dim=1)  # 35 + 6: 3 chunks
    s = cache.session("s0", tenant="t")
    seq, scores = greedy(model, turn, s.restore(turn))
    s.commit(seq)
    assert s.restore_source == "l1"
    ref_seq, ref_scores = reference(model, turn)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    assert cache.l1.fragmented >= 1 and cache.l1.outside == 0
    assert cache.counters.evictions["l1"] == evictions + 1
    assert not cache.session("s2", tenant="t").resident  # the oldest idle one made room
    assert s.bufs is not None and s.bufs.block is not None

    for name in ("s1", "s2"):  # the hibernated and the evicted come back whole
        turn = torch.cat([ids[name], torch.tensor([[2] * 3])], dim=1)
        s = cache.session(name, tenant="t")
        seq, _ = greedy(model, turn, s.restore(turn))
        s.commit(seq)
        assert s.restore_source in ("l2", "l3")
        assert torch.equal(seq, reference(model, turn)[0])
    cache.close()
