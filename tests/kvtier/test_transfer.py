"""The transfer engine on the CPU (and on CUDA where present): exact round trips through L2 and
L3, shedding of a full write queue, and detection of corrupt chunks on the way back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.codecs import make_codec
from kvtier.errors import ChecksumMismatch, ChunkNotFound, ConfigError, FingerprintMismatch
from kvtier.geometry import KVGeometry
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine

G = KVGeometry(3, 2, 8, 8, "bfloat16", "gqa")
CHUNK = 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layers(capacity: int, device: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (1, G.num_kv_heads, capacity, G.head_dim)
    return [
        (
            torch.randn(shape, generator=gen).to(G.torch_dtype()).to(device),
            torch.randn(shape, generator=gen).to(G.torch_dtype()).to(device),
        )
        for _ in range(G.num_layers)
    ]


def _empty_like(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in layers]


def _engine(device: str, codec: str = "native", store: object = None, **kw: int) -> TransferEngine:
    c = make_codec(codec, G)
    arena = HostArena(c.payload_bytes(CHUNK), 16 * 4096, pin=None)
    return TransferEngine(G, CHUNK, device, arena, store, c, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 4])
def test_offload_restore_is_bit_exact_with_native(device: str, batch: int) -> None:
    eng = _engine(device, batch_chunks=batch)
    src = _layers(64, device)
    dst = _empty_like(src)
    ntokens = 3 * CHUNK + 5  # three full chunks and a partial one
    slots = [eng.arena.alloc() for _ in range(4)]
    assert all(s is not None for s in slots)
    eng.offload_range(src, 0, ntokens, slots).wait()  # type: ignore[arg-type]
    # The slot holds the documented layout: [layer, k|v, token, head, dim].
    chunk = (
        eng.arena.view(slots[1])[: G.chunk_bytes(CHUNK)]
        .view(torch.bfloat16)
        .view(G.chunk_shape(CHUNK))
    )  # type: ignore[index]
    assert torch.equal(chunk[2, 1, 3], src[2][1][0, :, CHUNK + 3].cpu())
    eng.restore_range(slots, ntokens, dst, 0).wait()  # type: ignore[arg-type]
    for (k, v), (k2, v2) in zip(src, dst, strict=True):
        assert torch.equal(k[:, :, :ntokens], k2[:, :, :ntokens])
        assert torch.equal(v[:, :, :ntokens], v2[:, :, :ntokens])
        assert not k2[:, :, ntokens:].any()  # nothing written past the range
    stats = {(t.src, t.dst): t for t in eng.stats().transfers}
    assert stats["l1", "l2"].bytes == stats["l2", "l1"].bytes == G.chunk_bytes(ntokens)
    assert stats["l1", "l2"].ops == 4
    eng.close()
    eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_single_chunk_offload_to_another_position(device: str) -> None:
    eng = _engine(device)
    src = _layers(48, device, seed=1)
    dst = _empty_like(src)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(src, 20, CHUNK, slot).wait()
    eng.restore(slot, CHUNK, dst, 4).wait()
    for (k, v), (k2, v2) in zip(src, dst, strict=True):
        assert torch.equal(k[:, :, 20:36], k2[:, :, 4:20])
        assert torch.equal(v[:, :, 20:36], v2[:, :, 4:20])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_quantized_codecs_round_trip_closely(device: str, codec: str) -> None:
    eng = _engine(device, codec)
    src = _layers(32, device, seed=2)
    dst = _empty_like(src)
    slots = [eng.arena.alloc(), eng.arena.alloc()]
    eng.offload_range(src, 0, 2 * CHUNK, slots).wait()  # type: ignore[arg-type]
    eng.restore_range(slots, 2 * CHUNK, dst, 0).wait()  # type: ignore[arg-type]
    tol = 0.02 if codec == "int8" else 0.08
    for (k, v), (k2, v2) in zip(src, dst, strict=True):
        for a, b in ((k, k2), (v, v2)):
            rel = (a.float() - b.float()).norm() / a.float().norm()
            assert 0 < rel < tol


def test_bad_calls_raise_config_error() -> None:
    eng = _engine("cpu")
    src = _layers(32, "cpu")
    with pytest.raises(ConfigError, match="slots"):
        eng.offload_range(src, 0, 2 * CHUNK, [0])
    with pytest.raises(ConfigError, match="layers"):
        eng.offload(src[:2], 0, CHUNK, 0)
    with pytest.raises(ConfigError, match="no L3 store"):
        eng.write_l3(0, object())
    small = HostArena(4096, 4096, pin=False)
    with pytest.raises(ConfigError, match="slot"):
        TransferEngine(G, 4096, "cpu", small, None, make_codec("native", G))
    eng.close()
    with pytest.raises(ConfigError, match="closed"):
        eng.offload(src, 0, CHUNK, 0)


# ---- L3 -------------------------------------------------------------------------------------

l3 = pytest.importorskip("kvtier.tiers.l3")
kvbin = pytest.importorskip("kvtier.kvbin")


def _header(key: bytes, payload_len: int, codec: str = "native", tokens: int = CHUNK) -> object:
    return kvbin.ChunkHeader(
        key=key,
        parent=bytes(16),
        fingerprint=b"F" * 16,
        tenant="t",
        tokens=tokens,
        layers=G.num_layers,
        kv_heads=G.num_kv_heads,
        head_dim=G.head_dim,
        dtype=G.dtype,
        codec=codec,
        codec_params=make_codec(codec, G).params(),
        payload_len=payload_len,
        created=time.time(),
    )


@pytest.mark.parametrize("codec", ["native", "int8"])
def test_l1_to_l3_and_back(tmp_path: Path, codec: str) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", codec, store)
    src = _layers(CHUNK, "cpu", seed=3)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(src, 0, CHUNK, slot)
    size = eng.codec.payload_bytes(CHUNK)
    future = eng.write_l3(slot, _header(b"k" * 16, size, codec))
    assert future is not None
    future.result()
    eng.flush()
    eng.forget(slot)
    eng.arena.view(slot).zero_()
    header = eng.read_l3(b"k" * 16, slot, b"F" * 16).result()
    assert header.tokens == CHUNK and header.payload_len == size
    dst = _empty_like(src)
    eng.restore(slot, CHUNK, dst, 0).wait()
    expect = make_codec(codec, G).decode(make_codec(codec, G).encode(_stack(src)), CHUNK)
    assert torch.equal(_stack(dst), expect)
    stats = {(t.src, t.dst): t for t in eng.stats().transfers}
    assert stats["l2", "l3"].bytes == stats["l3", "l2"].bytes == size
    eng.close()
    store.close()


def _stack(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.stack(
        [torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers]
    )


def test_corrupt_l3_chunk_is_an_error_never_data(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", store)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(_layers(CHUNK, "cpu"), 0, CHUNK, slot)
    size = eng.codec.payload_bytes(CHUNK)
    eng.write_l3(slot, _header(b"c" * 16, size)).result()  # type: ignore[union-attr]
    path = next((tmp_path / "l3").rglob("*.kvbin"))
    with open(path, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch):
        eng.read_l3(b"c" * 16, slot, b"F" * 16).result()
    with pytest.raises(ChunkNotFound):  # quarantined: a miss from now on
        eng.read_l3(b"c" * 16, slot, b"F" * 16).result()
    eng.write_l3(slot, _header(b"d" * 16, size)).result()  # type: ignore[union-attr]
    with pytest.raises(FingerprintMismatch):  # another model's chunk
        eng.read_l3(b"d" * 16, slot, b"G" * 16).result()
    assert eng.stats().l3_read_errors == 3
    eng.close()
    store.close()


class _SlowStore:
    """An L3 store whose writes take a while: a stand-in for a saturated disk."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def put(self, header: object, payload: object) -> object:
        time.sleep(0.2)
        return self.inner.put(header, payload)  # type: ignore[attr-defined]


def test_full_write_queue_sheds_instead_of_stalling(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", _SlowStore(store), l3_write_queue=2, l3_threads=1)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(_layers(CHUNK, "cpu"), 0, CHUNK, slot)
    size = eng.codec.payload_bytes(CHUNK)
    t0 = time.perf_counter()
    results = [eng.write_l3(slot, _header(bytes([i]) * 16, size)) for i in range(6)]
    assert time.perf_counter() - t0 < 0.15  # returned at once, no waiting on the disk
    assert sum(r is None for r in results) == 4
    stats = eng.stats()
    assert stats.shed_writes == 4 and stats.l3_write_queue == 2
    eng.flush()
    assert eng.stats().l3_write_queue == 0
    assert store.contains(bytes([0]) * 16) and store.contains(bytes([1]) * 16)
    eng.close()
    store.close()
