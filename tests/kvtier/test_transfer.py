"""The transfer engine on the CPU (and on CUDA where present): exact round trips through L2 and
L3, shedding of a full write queue, and detection of corrupt chunks on the way back."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from kvtier.codecs import make_codec
from kvtier.errors import (
    ChecksumMismatch,
    ChunkNotFound,
    ConfigError,
    FingerprintMismatch,
    StoreIOError,
)
from kvtier.geometry import KVGeometry
from kvtier.tiers.l1 import block_of
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


def _fuse(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same values in L1Pool's layout: views of one [layer, k|v, 1, H, T, D] tensor, which
    the engine moves with one copy per group instead of one per layer and plane."""
    block = torch.stack([torch.stack([k, v]) for k, v in layers])
    fused = [(block[i, 0], block[i, 1]) for i in range(len(layers))]
    assert block_of(fused) is block
    return fused


def _layout(layers: list[tuple[torch.Tensor, torch.Tensor]], fused: bool):  # type: ignore[no-untyped-def]
    return _fuse(layers) if fused else layers


def _empty_like(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeros in the same layout (fused or one tensor per layer and plane) as `layers`."""
    zeros = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in layers]
    return _fuse(zeros) if block_of(layers) is not None else zeros


def _stack(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.stack(
        [torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers]
    )


def _slots(arena: HostArena, count: int) -> list[int]:
    """`count` free L2 slots of `arena`."""
    got = [arena.alloc() for _ in range(count)]
    slots = [slot for slot in got if slot is not None]
    assert len(slots) == count, "the test arena is too small"
    return slots


def _engine(
    device: str, codec: str = "native", store: object = None, process: bool = False, **kw: int
) -> TransferEngine:
    c = make_codec(codec, G)
    arena = HostArena(c.payload_bytes(CHUNK), 16 * 4096, pin=None, shared=process)
    return TransferEngine(G, CHUNK, device, arena, store, c, writer_process=process, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_offload_restore_is_bit_exact_with_native(device: str, batch: int, fused: bool) -> None:
    eng = _engine(device, group_chunks=batch)
    src = _layout(_layers(64, device), fused)
    dst = _empty_like(src)
    ntokens = 3 * CHUNK + 5  # three full chunks and a partial one
    slots = _slots(eng.arena, 4)
    assert all(s is not None for s in slots)
    eng.offload_range(src, 0, ntokens, slots).wait()
    # The slot holds the documented layout: [layer, k|v, token, head, dim].
    chunk = (
        eng.arena.view(slots[1])[: G.chunk_bytes(CHUNK)]
        .view(torch.bfloat16)
        .view(G.chunk_shape(CHUNK))
    )  # type: ignore[index]
    assert torch.equal(chunk[2, 1, 3], src[2][1][0, :, CHUNK + 3].cpu())
    eng.restore_range(slots, ntokens, dst, 0).wait()
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
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_codecs_round_trip_closely(device: str, codec: str, fused: bool) -> None:
    eng = _engine(device, codec)
    src = _layout(_layers(32, device, seed=2), fused)
    dst = _empty_like(src)
    slots = _slots(eng.arena, 2)
    eng.offload_range(src, 0, 2 * CHUNK, slots).wait()
    eng.restore_range(slots, 2 * CHUNK, dst, 0).wait()
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


def _span(layers: list, first: int, n: int) -> torch.Tensor:
    return _stack([(k[:, :, first : first + n], v[:, :, first : first + n]) for k, v in layers])


def _lossy(
    codec: str, geometry: KVGeometry, layers: list, start: int, ntokens: int, chunk: int
) -> torch.Tensor:
    """What a lossy round trip must give: each chunk encoded and decoded on its own."""
    c = make_codec(codec, geometry)
    out = []
    for first in range(start, start + ntokens, chunk):
        n = min(chunk, start + ntokens - first)
        part = [(k[:, :, first : first + n], v[:, :, first : first + n]) for k, v in layers]
        out.append(c.decode(c.encode(_stack(part)), n))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("codec", ["native", "int8"])
@pytest.mark.parametrize("group", [1, 3])
def test_groups_and_a_partial_chunk_at_an_offset(codec: str, group: int) -> None:
    eng = _engine("cpu", codec, group_chunks=group)
    src = _layers(9 * CHUNK, "cpu", seed=5)
    dst = _empty_like(src)
    start, ntokens = 7, 7 * CHUNK + 3  # 7 full chunks (groups of 3: 3+3+1) and a partial one
    slots = _slots(eng.arena, 8)
    eng.offload_range(src, start, ntokens, slots).wait()
    eng.restore_range(slots, ntokens, dst, start + 2).wait()
    got = _span(dst, start + 2, ntokens)
    if codec == "native":
        want = _span(src, start, ntokens)
    else:
        want = _lossy(codec, G, src, start, ntokens, CHUNK)
    assert torch.equal(got, want)
    for k, v in dst:  # nothing written outside the range
        assert not k[:, :, : start + 2].any() and not v[:, :, start + 2 + ntokens :].any()
    scratch = 4 * eng.codec.scratch_elems(CHUNK)  # the codec's float32 work buffer
    want_staging = 2 * (group * G.chunk_bytes(CHUNK) + scratch)
    assert eng.staging_bytes == (0 if codec == "native" else want_staging)
    eng.close()
    assert eng.staging_bytes == 0


def test_ranges_outside_the_buffers_are_refused() -> None:
    eng = _engine("cpu")
    src = _layers(2 * CHUNK, "cpu")
    slots = [0, 1]
    with pytest.raises(ConfigError, match="do not fit"):
        eng.offload_range(src, 1, 2 * CHUNK, slots)
    with pytest.raises(ConfigError, match="do not fit"):
        eng.restore_range(slots, 2 * CHUNK, src, -1)
    bad = [(k[:, :1], v[:, :1]) for k, v in src]  # one head where the geometry has two
    with pytest.raises(ConfigError, match="do not fit"):
        eng.offload(bad, 0, CHUNK, 0)
    with pytest.raises(ConfigError, match="group_chunks"):
        _engine("cpu", group_chunks=0)
    eng.close()


# ---- CUDA: streams, events, staging reuse ---------------------------------------------------

GPU_G = KVGeometry(8, 4, 128, 128, "bfloat16", "gqa")  # 1 MiB per 64-token chunk
GPU_CHUNK = 64
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_engine(codec: str = "native", group: int = 3, slots: int = 64) -> TransferEngine:
    c = make_codec(codec, GPU_G)
    arena = HostArena(c.payload_bytes(GPU_CHUNK), slots * c.payload_bytes(GPU_CHUNK), pin=None)
    return TransferEngine(GPU_G, GPU_CHUNK, "cuda", arena, None, c, group_chunks=group)


def _gpu_layers(capacity: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, GPU_G.num_kv_heads, capacity, GPU_G.head_dim)
    return [
        (
            torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
            torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
        )
        for _ in range(GPU_G.num_layers)
    ]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("pin", [None, False])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_round_trip_is_bit_exact(group: int, pin: bool | None, fused: bool) -> None:
    c = make_codec("native", GPU_G)
    arena = HostArena(c.payload_bytes(GPU_CHUNK), 32 * c.payload_bytes(GPU_CHUNK), pin=pin)
    eng = TransferEngine(GPU_G, GPU_CHUNK, "cuda", arena, None, c, group_chunks=group)
    ntokens = 10 * GPU_CHUNK + 17  # ten full chunks (several groups, staging reused) + partial
    slots = _slots(arena, 11)
    for round_ in range(3):  # the staging buffers alternate across calls too
        src = _layout(_gpu_layers(12 * GPU_CHUNK, seed=round_), fused)  # on the current stream
        dst = _layout([(torch.full_like(k, 7.0), torch.full_like(v, 7.0)) for k, v in src], fused)
        eng.offload_range(src, 5, ntokens, slots)  # no wait: ordered
        handle = eng.restore_range(slots, ntokens, dst, 9)
        if round_ == 0:
            handle.wait_stream()  # the current stream reads dst only after the restore
        else:
            handle.wait(spin=round_ == 1)  # the host waits: spinning, then sleeping
        assert torch.equal(_span(dst, 9, ntokens), _span(src, 5, ntokens))
        for k, v in dst:
            assert (k[:, :, :9] == 7).all() and (v[:, :, 9 + ntokens :] == 7).all()
    assert eng.staging_bytes == 4 * group * GPU_G.chunk_bytes(GPU_CHUNK)
    assert eng.stats().staging_bytes == eng.staging_bytes
    eng.close()
    arena.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_both_directions_at_once(fused: bool) -> None:
    eng = _gpu_engine(group=3)
    n = 7 * GPU_CHUNK + 40
    a = _layout(_gpu_layers(8 * GPU_CHUNK, 10), fused)
    b = _layout(_gpu_layers(8 * GPU_CHUNK, 11), fused)
    up = _slots(eng.arena, 8)
    down = _slots(eng.arena, 8)
    eng.offload_range(b, 0, n, up).wait()
    b_copy = _span(b, 0, n).clone()
    for _ in range(3):
        out = _empty_like(b)
        h_down = eng.offload_range(a, 0, n, down)
        h_up = eng.restore_range(up, n, out, 0)
        h_down.wait()
        h_up.wait()
        assert torch.equal(_span(out, 0, n), b_copy)
    back = _empty_like(a)
    eng.restore_range(down, n, back, 0).wait()
    assert torch.equal(_span(back, 0, n), _span(a, 0, n))
    for slot in up + down:
        assert not eng.busy(slot)
        eng.forget(slot)
    eng.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_cuda_quantized_codec_matches_the_codec(codec: str) -> None:
    eng = _gpu_engine(codec, group=4)
    n = 9 * GPU_CHUNK + 5
    src = _gpu_layers(10 * GPU_CHUNK, 12)
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    slots = _slots(eng.arena, 10)
    eng.offload_range(src, 3, n, slots)
    eng.restore_range(slots, n, dst, 3).wait()
    assert torch.equal(_span(dst, 3, n), _lossy(codec, GPU_G, src, 3, n, GPU_CHUNK))
    rel = (_span(dst, 3, n).float() - _span(src, 3, n).float()).norm() / _span(
        src, 3, n
    ).float().norm()
    assert 0 < rel < (0.02 if codec == "int8" else 0.08)
    eng.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_quantizing_allocates_no_plane_sized_temporaries() -> None:
    """The codec works in the engine's own scratch: nothing chunk-sized is allocated on the
    side streams, where the caching allocator would keep it away from the model."""
    eng = _gpu_engine("int8", group=4)
    n = 8 * GPU_CHUNK
    src = _gpu_layers(n, 13)
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    slots = _slots(eng.arena, 8)
    eng.offload_range(src, 0, n, slots)
    eng.restore_range(slots, n, dst, 0).wait()  # warm-up: the views and small scale tensors
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eng.offload_range(src, 0, n, slots)
    eng.restore_range(slots, n, dst, 0).wait()
    torch.cuda.synchronize()
    plane = GPU_G.chunk_bytes(GPU_CHUNK) // 2 // GPU_G.element_size * 4  # one plane in float32
    assert torch.cuda.max_memory_allocated() - base < plane // 4
    eng.close()


# ---- L3 -------------------------------------------------------------------------------------

l3 = pytest.importorskip("kvtier.tiers.l3")
kvbin = pytest.importorskip("kvtier.kvbin")


def _header(key: bytes, codec: str = "native", tokens: int = CHUNK) -> object:
    return make_codec(codec, G).header(key, tokens, fingerprint=b"F" * 16, tenant="t")


@pytest.mark.parametrize("codec", ["native", "int8"])
@pytest.mark.parametrize("process", [False, True], ids=["threads", "writer-process"])
def test_l1_to_l3_and_back(tmp_path: Path, codec: str, process: bool) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", codec, store, process)
    src = _layers(CHUNK, "cpu", seed=3)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(src, 0, CHUNK, slot)
    size = eng.codec.payload_bytes(CHUNK)
    future = eng.write_l3(slot, _header(b"k" * 16, codec))
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


def test_corrupt_l3_chunk_is_an_error_never_data(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", store)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(_layers(CHUNK, "cpu"), 0, CHUNK, slot)
    eng.write_l3(slot, _header(b"c" * 16)).result()  # type: ignore[union-attr]
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
    eng.write_l3(slot, _header(b"d" * 16)).result()  # type: ignore[union-attr]
    with pytest.raises(FingerprintMismatch):  # another model's chunk
        eng.read_l3(b"d" * 16, slot, b"G" * 16).result()
    assert eng.stats().l3_read_errors == 3
    eng.close()
    store.close()


class _SlowStore:
    """An L3 store whose writes take a while: a stand-in for a saturated disk."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def put(self, header: object, payload: object, **kw: object) -> object:
        time.sleep(0.2)
        return self.inner.put(header, payload, **kw)  # type: ignore[attr-defined]


def test_full_write_queue_sheds_instead_of_stalling(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", _SlowStore(store), l3_write_queue=2, l3_threads=1)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(_layers(CHUNK, "cpu"), 0, CHUNK, slot)
    t0 = time.perf_counter()
    results = [eng.write_l3(slot, _header(bytes([i]) * 16)) for i in range(6)]
    assert time.perf_counter() - t0 < 0.15  # returned at once, no waiting on the disk
    assert sum(r is None for r in results) == 4
    stats = eng.stats()
    assert stats.shed_writes == 4 and stats.l3_write_queue == 2
    eng.flush()
    assert eng.stats().l3_write_queue == 0
    assert store.contains(bytes([0]) * 16) and store.contains(bytes([1]) * 16)
    eng.close()
    store.close()


def test_restore_does_not_wait_for_the_chunks_l3_write(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", _SlowStore(store))  # each put takes 0.2 s
    src = _layers(CHUNK, "cpu", seed=4)
    slot = eng.arena.alloc()
    assert slot is not None
    eng.offload(src, 0, CHUNK, slot)
    future = eng.write_l3(slot, _header(b"w" * 16))
    assert future is not None
    dst = _empty_like(src)
    t0 = time.perf_counter()
    eng.restore(slot, CHUNK, dst, 0).wait()  # both only read the slot: no need to wait
    assert time.perf_counter() - t0 < 0.1
    assert not future.done() and eng.busy(slot)
    assert torch.equal(_stack(dst), _stack(src))
    eng.forget(slot)  # before the slot may be reused: waits for the write
    assert future.done() and store.contains(b"w" * 16)
    eng.close()
    store.close()


def _store_session(
    eng: TransferEngine, layers: list, ntokens: int, chunk: int, geometry: KVGeometry
) -> tuple[list[bytes], list[int]]:
    """Offload `ntokens` tokens and write each chunk to L3; returns (keys, slots)."""
    slots = _slots(eng.arena, -(-ntokens // chunk))
    eng.offload_range(layers, 0, ntokens, slots)
    keys = []
    for i, slot in enumerate(slots):
        n = min(chunk, ntokens - i * chunk)
        key = bytes([i + 1]) * 16
        header = eng.codec.header(key, n, fingerprint=b"F" * 16, tenant="t")
        eng.write_l3(slot, header).result()  # type: ignore[union-attr]
        keys.append(key)
    for slot in slots:
        eng.forget(slot)
        eng.arena.view(slot).zero_()
    return keys, slots


def test_restore_right_after_l3_reads_waits_for_each_chunk(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", store, group_chunks=2)
    n = 4 * CHUNK + 9
    src = _layers(5 * CHUNK, "cpu", seed=6)
    keys, slots = _store_session(eng, src, n, CHUNK, G)
    for _ in range(2):
        dst = _empty_like(src)
        for key, slot in zip(keys, slots, strict=True):
            eng.read_l3(key, slot, b"F" * 16)  # not waited: the restore waits chunk by chunk
        eng.restore_range(slots, n, dst, 0).wait()
        assert torch.equal(_span(dst, 0, n), _span(src, 0, n))
    eng.close()
    store.close()


def test_a_failed_l3_read_never_reaches_l1(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", store)
    n = 3 * CHUNK
    src = _layers(n, "cpu", seed=7)
    keys, slots = _store_session(eng, src, n, CHUNK, G)
    path = next(p for p in (tmp_path / "l3").rglob("*.kvbin") if keys[1].hex() in p.name)
    with open(path, "r+b") as f:  # corrupt the second chunk's payload
        f.seek(4096 + 10)
        byte = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([byte[0] ^ 0x55]))
    for key, slot in zip(keys, slots, strict=True):
        eng.read_l3(key, slot, b"F" * 16)
    dst = _empty_like(src)
    with pytest.raises(ChecksumMismatch):
        eng.restore_range(slots, n, dst, 0).wait()
    assert torch.equal(_span(dst, 0, CHUNK), _span(src, 0, CHUNK))  # the chunk before it
    for k, v in dst:
        assert not k[:, :, CHUNK:].any() and not v[:, :, CHUNK:].any()
    for slot in slots:
        eng.forget(slot)
    eng.close()
    store.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_restore_overlapping_l3_reads(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    c = make_codec("native", GPU_G)
    arena = HostArena(c.payload_bytes(GPU_CHUNK), 16 * c.payload_bytes(GPU_CHUNK), pin=None)
    eng = TransferEngine(GPU_G, GPU_CHUNK, "cuda", arena, store, c, group_chunks=3)
    n = 7 * GPU_CHUNK + 30
    src = _gpu_layers(8 * GPU_CHUNK, 13)
    keys, slots = _store_session(eng, src, n, GPU_CHUNK, GPU_G)
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    for key, slot in zip(keys, slots, strict=True):
        eng.read_l3(key, slot, b"F" * 16)
    eng.restore_range(slots, n, dst, 0).wait()
    assert torch.equal(_span(dst, 0, n), _span(src, 0, n))
    eng.close()
    store.close()
    arena.close()


def test_writer_process_dies_writes_fail_typed_and_nothing_stored_is_lost(tmp_path: Path) -> None:
    store = l3.L3Store(tmp_path / "l3")
    eng = _engine("cpu", "native", store, process=True)
    proc = eng._proc
    assert proc is not None
    slot = eng.arena.alloc()
    assert slot is not None
    src = _layers(CHUNK, "cpu", seed=9)
    eng.offload(src, 0, CHUNK, slot)
    eng.write_l3(slot, _header(b"a" * 16)).result()  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(StoreIOError, match="writer process is gone"):
        eng.write_l3(slot, _header(b"b" * 16)).result()  # type: ignore[union-attr]
    assert not store.contains(b"b" * 16)
    assert not list((tmp_path / "l3").rglob("*.tmp"))  # no half-written file left visible
    eng.arena.view(slot).zero_()
    eng.read_l3(b"a" * 16, slot, b"F" * 16).result()  # what was stored is still there, intact
    dst = _empty_like(src)
    eng.restore(slot, CHUNK, dst, 0).wait()
    assert torch.equal(_stack(dst), _stack(src))
    eng.close()
    store.close()


def test_writer_process_needs_a_shared_arena(tmp_path: Path) -> None:
    c = make_codec("native", G)
    arena = HostArena(c.payload_bytes(CHUNK), 4 * 4096, pin=None)
    with l3.L3Store(tmp_path / "l3") as store, pytest.raises(ConfigError, match="shared=True"):
        TransferEngine(G, CHUNK, "cpu", arena, store, c, writer_process=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["native", "int8"])
@pytest.mark.parametrize("batch", [1, 4])
def test_restore_chunks_hands_over_what_restore_range_lands_in_l1(
    device: str, codec: str, batch: int
) -> None:
    """`restore_chunks` gives its `write` the chunks (decoded, for a quantizing codec) in the
    chunk layout, each at its first token: what `restore_range` writes into L1 buffers."""
    eng = _engine(device, codec, group_chunks=batch)
    src = _layers(64, device)
    ntokens = 3 * CHUNK + 5
    slots = _slots(eng.arena, 4)
    eng.offload_range(src, 0, ntokens, slots).wait()
    in_l1 = _empty_like(src)
    eng.restore_range(slots, ntokens, in_l1, 0).wait()
    got = torch.zeros_like(_stack(src))[:, :, :ntokens]  # [layer, k|v, token, head, dim]
    firsts: list[int] = []

    def write(first: int, chunks: torch.Tensor) -> None:
        assert chunks.device.type == torch.device(device).type
        firsts.append(first)
        for c in range(chunks.shape[0]):
            a = first + c * chunks.shape[3]
            got[:, :, a : a + chunks.shape[3]] = chunks[c]

    eng.restore_chunks(slots, ntokens, write).wait()
    assert torch.equal(got, _stack(in_l1)[:, :, :ntokens])
    assert firsts == sorted(firsts) and firsts[0] == 0
    with pytest.raises(ConfigError, match="slots"):
        eng.restore_chunks(slots[:2], ntokens, write)
    eng.close()
