"""L1Pool: one allocation per session with per-layer views, growth in whole chunks, and the
per-layer fallback when no contiguous block can be had."""

from __future__ import annotations

import pytest
import torch

from kvtier.codecs import make_codec
from kvtier.errors import ConfigError, L1BudgetExceeded
from kvtier.geometry import KVGeometry
from kvtier.tiers.l1 import L1Pool, block_of
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine

G = KVGeometry(3, 2, 8, 8, "float32", "gqa")
CHUNK = 16


def test_one_block_per_session_grows_in_chunks_and_keeps_tokens() -> None:
    pool = L1Pool(G, 1 << 20, "cpu", CHUNK)
    bufs = pool.allocate(20)
    assert bufs.capacity == 32 and pool.used_bytes == G.bytes_per_token * 32
    block = block_of(bufs.layers)
    assert block is not None and block.shape == (3, 2, 1, 2, 32, 8)
    for i, (k, v) in enumerate(bufs.layers):
        k[:, :, :20] = i
        v[:, :, :20] = -i
    pool.grow(bufs, 40, keep=20)
    assert bufs.capacity == 48 and pool.used_bytes == G.bytes_per_token * 48
    assert block_of(bufs.layers) is not None
    for i, (k, v) in enumerate(bufs.layers):
        assert (k[:, :, :20] == i).all() and (v[:, :, :20] == -i).all()
    pool.release(bufs)
    pool.release(bufs)
    assert pool.used_bytes == 0


def test_budget_is_enforced() -> None:
    pool = L1Pool(G, G.bytes_per_token * CHUNK, "cpu", CHUNK)
    pool.allocate(CHUNK)
    with pytest.raises(L1BudgetExceeded, match="raise l1_bytes"):
        pool.allocate(1)


def test_no_contiguous_block_falls_back_to_per_layer_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_empty = torch.empty

    def no_big_blocks(*shape, **kw):  # type: ignore[no-untyped-def]
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if len(dims) == 6:  # the one-block layout: as if the device had no range that large
            raise torch.OutOfMemoryError("no contiguous range")
        return real_empty(*shape, **kw)

    pool = L1Pool(G, 1 << 20, "cpu", CHUNK)
    monkeypatch.setattr(torch, "empty", no_big_blocks)
    bufs = pool.allocate(3 * CHUNK)
    monkeypatch.undo()
    assert pool.split_allocations == 1
    assert block_of(bufs.layers) is None
    assert len(bufs.layers) == 3 and bufs.layers[0][0].shape == (1, 2, 48, 8)
    # The engine moves that layout too, bit for bit.
    codec = make_codec("native", G)
    arena = HostArena(codec.payload_bytes(CHUNK), 8 * codec.payload_bytes(CHUNK), pin=None)
    engine = TransferEngine(G, CHUNK, "cpu", arena, None, codec)
    for k, v in bufs.layers:
        k.normal_()
        v.normal_()
    slots = [arena.alloc() for _ in range(3)]
    engine.offload_range(bufs.layers, 0, 3 * CHUNK, slots).wait()  # type: ignore[arg-type]
    fused = pool.allocate(3 * CHUNK)
    assert block_of(fused.layers) is not None
    engine.restore_range(slots, 3 * CHUNK, fused.layers, 0).wait()  # type: ignore[arg-type]
    for (k, v), (k2, v2) in zip(bufs.layers, fused.layers, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    engine.close()
    arena.close()


def test_engine_takes_the_block_and_refuses_a_wrong_one() -> None:
    pool = L1Pool(G, 1 << 20, "cpu", CHUNK)
    a, b = pool.allocate(2 * CHUNK), pool.allocate(2 * CHUNK)
    assert a.block is not None and a.block is block_of(a.layers)
    for k, v in a.layers:
        k.normal_()
        v.normal_()
    codec = make_codec("native", G)
    arena = HostArena(codec.payload_bytes(CHUNK), 4 * codec.payload_bytes(CHUNK), pin=None)
    engine = TransferEngine(G, CHUNK, "cpu", arena, None, codec)
    slots = [arena.alloc(), arena.alloc()]
    engine.offload_range(a.layers, 0, 2 * CHUNK, slots, block=a.block).wait()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not the L1Pool block"):
        engine.restore_range(slots, 2 * CHUNK, b.layers, 0, block=a.block)  # type: ignore[arg-type]
    engine.restore_range(slots, 2 * CHUNK, b.layers, 0, block=b.block).wait()  # type: ignore[arg-type]
    assert torch.equal(a.block, b.block)
    engine.close()
    arena.close()
