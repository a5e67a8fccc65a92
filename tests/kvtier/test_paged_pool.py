"""PagePool: sizing, alloc/free/refcount, copy-on-write, no tensor work in the page accounting,
and the chunk <-> pages gather/scatter used by the L2 restore/offload path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.paged import CHUNK_TOKENS, PagedSequence, PagePool

GEO = KVGeometry(2, 2, 16, 16, "float32", "gqa")
PAGE_BYTES_16 = 16 * GEO.bytes_per_token  # one page of 16 tokens, all layers, K and V


def _pool(pages: int = 8, page_size: int = 16, dtype: torch.dtype | None = None) -> PagePool:
    per_page = page_size * GEO.bytes_per_token
    if dtype is not None:
        per_page = per_page // 4 * torch.empty((), dtype=dtype).element_size()
    return PagePool(GEO, pages * per_page + per_page - 1, page_size=page_size, dtype=dtype)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sizing_from_budget_and_geometry() -> None:
    pool = PagePool(GEO, 10 * PAGE_BYTES_16 + 5, page_size=16)
    assert pool.num_pages == 10 and pool.num_free == 10
    assert pool.kv.shape == (2, 2, 10, 16, 2, 16)
    assert pool.kv.dtype == torch.float32
    assert pool.page_bytes == PAGE_BYTES_16
    half = PagePool(GEO, 10 * PAGE_BYTES_16, page_size=16, dtype=torch.bfloat16)
    assert half.num_pages == 20 and half.kv.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [0, -16, 24, 512, 3])
def test_page_size_must_divide_the_chunk(bad: int) -> None:
    with pytest.raises(ConfigError, match="divisor"):
        PagePool(GEO, 1 << 20, page_size=bad)


def test_budget_too_small_for_one_page() -> None:
    with pytest.raises(ConfigError, match="holds no page"):
        PagePool(GEO, PAGE_BYTES_16 - 1, page_size=16)


def test_alloc_free_and_full_pool_returns_none() -> None:
    pool = _pool(4)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    assert pool.alloc(2) is None
    assert pool.num_free == 1, "a failed alloc takes nothing"
    b = pool.alloc(1)
    assert b == [3] and pool.alloc(1) is None
    pool.free(a)
    assert pool.num_free == 3 and all(pool.refcount(p) == 0 for p in a)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0]])
    assert pool.alloc(0) == []


def test_refcounts_keep_shared_pages_until_the_last_holder_frees() -> None:
    pool = _pool(4)
    pages = pool.alloc(2)
    assert pages is not None
    other = pool.share(pages)
    assert [pool.refcount(p) for p in pages] == [2, 2]
    pool.free(pages)
    assert pool.num_free == 2 and [pool.refcount(p) for p in other] == [1, 1]
    pool.free(other)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="is free"):
        pool.share(other)


def test_copy_on_write_of_a_shared_partial_tail_page() -> None:
    pool = _pool(8)
    a = PagedSequence()
    assert pool.reserve(a, 20)  # pages 0 (full) and 1 (4 of 16 tokens)
    a.length = 20
    pool.kv[:, :, a.pages].normal_()
    before = pool.kv.clone()
    b = pool.fork(a)
    assert b.pages == a.pages and b.length == 20
    assert pool.pages_needed(b, 1) == 1  # the copy of the partial tail page
    assert pool.reserve(b, 1)
    assert b.pages[0] == a.pages[0], "the full page stays shared"
    assert b.pages[1] != a.pages[1], "the partial tail page was copied"
    assert pool.refcount(a.pages[0]) == 2 and pool.refcount(a.pages[1]) == 1
    assert torch.equal(pool.kv[:, :, b.pages[1]], before[:, :, a.pages[1]])
    assert torch.equal(pool.kv[:, :, a.pages], before[:, :, a.pages]), "a's KV is untouched"
    # `a` now owns its tail page alone: appending to it copies nothing.
    assert pool.pages_needed(a, 1) == 0
    pages = list(a.pages)
    assert pool.reserve(a, 1) and a.pages == pages


def test_fork_at_a_page_boundary_copies_nothing() -> None:
    pool = _pool(8)
    a = PagedSequence()
    assert pool.reserve(a, 32)
    a.length = 32
    b = pool.fork(a)
    assert pool.pages_needed(b, 1) == 1  # a fresh page, no copy
    assert pool.reserve(b, 1)
    assert b.pages[:2] == a.pages and len(b.pages) == 3
    part = pool.fork(a, 16)
    assert part.pages == a.pages[:1] and pool.refcount(a.pages[0]) == 3


def test_reserve_on_a_full_pool_changes_nothing() -> None:
    pool2 = _pool(2)
    c = PagedSequence()
    assert pool2.reserve(c, 16)
    c.length = 10
    d = pool2.fork(c)
    pages, free = list(d.pages), pool2.num_free
    assert pool2.pages_needed(d, 20) == 2 > free  # copy of the tail + one new page
    assert pool2.reserve(d, 20) is False
    assert d.pages == pages and pool2.num_free == free and pool2.refcount(pages[0]) == 2


def test_page_accounting_makes_no_tensor() -> None:
    pool = _pool(8)
    seq = PagedSequence()
    data_ptr = pool.kv.data_ptr()
    with _CountOps() as mode:
        assert pool.reserve(seq, 40)
        seq.length = 40
        other = pool.fork(seq, 32)
        assert pool.reserve(other, 5)  # starts a fresh page: no copy
        pages = pool.alloc(2)
        assert pages is not None
        pool.free(pages)
        pool.release(other)
        pool.release(seq)
    assert mode.ops == []
    assert pool.kv.data_ptr() == data_ptr and pool.num_free == 8


def test_chunk_pages_map_a_chunk_to_its_pages() -> None:
    pool = PagePool(GEO, 64 * PAGE_BYTES_16 // 2, page_size=8)
    table = list(range(63, -1, -1))  # 64 pages of 8 tokens = 512 tokens = 2 chunks
    per_chunk = CHUNK_TOKENS // 8
    assert pool.chunk_pages(table, 0) == table[:per_chunk]
    assert pool.chunk_pages(table, 1) == table[per_chunk:]
    assert pool.chunk_pages(table[:40], 1) == table[per_chunk:40]  # partial last chunk
    assert pool.chunk_pages(table, 2) == []


@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_round_trip_is_bit_exact(page_size: int, dtype: torch.dtype) -> None:
    pages_per_seq = 2 * CHUNK_TOKENS // page_size
    pool = _pool(2 * pages_per_seq, page_size=page_size, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**15), 2**15, pool.kv.shape, generator=g, dtype=torch.int16)
    if dtype == torch.bfloat16:
        pool.kv.view(torch.int16).copy_(bits)  # every bit pattern, NaNs included
    else:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    free = pool.alloc(pool.num_free)
    assert free is not None
    perm = torch.randperm(len(free), generator=g).tolist()
    src_table = [free[i] for i in perm[:pages_per_seq]]  # scattered, out-of-order pages
    dst_table = [free[i] for i in perm[pages_per_seq:]]

    chunk = pool.gather(src_table, CHUNK_TOKENS, 2 * CHUNK_TOKENS)
    assert chunk.shape == GEO.chunk_shape(CHUNK_TOKENS) and chunk.is_contiguous()
    s = page_size
    for t in (0, 1, s - 1, s, CHUNK_TOKENS - 1):
        token = CHUNK_TOKENS + t
        page, off = src_table[token // s], token % s
        assert torch.equal(
            chunk[:, :, t].view(torch.uint8), pool.kv[:, :, page, off].view(torch.uint8)
        )
    for layer in range(GEO.num_layers):
        k, v = pool.gather_layer(src_table, CHUNK_TOKENS, 2 * CHUNK_TOKENS, layer)
        assert torch.equal(k.view(torch.uint8), chunk[layer, 0].view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), chunk[layer, 1].view(torch.uint8))

    slot = torch.empty_like(chunk)  # stands for an L2 slot
    pool.gather(src_table, CHUNK_TOKENS, 2 * CHUNK_TOKENS, out=slot)
    pool.scatter(dst_table, 0, slot)
    back = pool.gather(dst_table, 0, CHUNK_TOKENS)
    assert torch.equal(back.view(torch.uint8), chunk.view(torch.uint8))
    # A range that starts and ends inside pages round-trips too.
    mid = pool.gather(src_table, 3, 3 + 100)
    pool.scatter(dst_table, 7, mid)
    assert torch.equal(pool.gather(dst_table, 7, 107).view(torch.uint8), mid.view(torch.uint8))


def test_scatter_refuses_shared_pages_and_bad_shapes() -> None:
    pool = _pool(4)
    seq = PagedSequence()
    assert pool.reserve(seq, 32)
    seq.length = 32
    data = pool.gather(seq.pages, 0, 16)
    twin = pool.fork(seq)
    with pytest.raises(ValueError, match="shared"):
        pool.scatter(seq.pages, 0, data)
    pool.release(twin)
    pool.scatter(seq.pages, 0, data)
    with pytest.raises(ValueError, match="need"):
        pool.scatter(seq.pages, 0, data[:, :1])
    with pytest.raises(ValueError, match="outside"):
        pool.gather(seq.pages, 20, 40)


@pytest.mark.parametrize("page_size", [16, CHUNK_TOKENS])
def test_write_chunks_lands_chunks_from_a_token_on(page_size: int) -> None:
    """`write_chunks` (what a restore from L2 lands with): consecutive chunks, the last
    partial, go to their tokens' pages; tokens before `start` (pages the table shares) are not
    written. With 256-token pages a chunk is one page (one copy); otherwise a scatter."""
    pages_per_seq = 3 * CHUNK_TOKENS // page_size
    pool = _pool(2 * pages_per_seq, page_size=page_size)
    g = torch.Generator().manual_seed(3)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    free = pool.alloc(pool.num_free)
    assert free is not None
    src, dst = free[:pages_per_seq], free[pages_per_seq:][::-1]  # out of order
    n = 2 * CHUNK_TOKENS + 40
    want = pool.gather(src, 0, n)
    before = pool.gather(dst, 0, n)
    chunks = [want[:, :, a : a + CHUNK_TOKENS] for a in range(0, n, CHUNK_TOKENS)]
    pool.write_chunks(dst, 0, torch.stack(chunks[:2]), start=page_size)  # a group of two
    pool.write_chunks(dst, 2 * CHUNK_TOKENS, chunks[2].unsqueeze(0), start=page_size)
    got = pool.gather(dst, 0, n)
    assert torch.equal(got[:, :, page_size:], want[:, :, page_size:])
    assert torch.equal(got[:, :, :page_size], before[:, :, :page_size])  # left as it was


class _IndexSizes(_CountOps):
    """The token count (dim 2) of every index_select and index_copy_ on the pool's flat view."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if "index_select" in str(func) or "index_copy" in str(func):
            self.tokens.append(int(args[2].numel()))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("n", [CHUNK_TOKENS + 1, 3 * CHUNK_TOKENS - 5])
def test_a_spill_to_the_host_moves_one_chunk_at_a_time(n: int) -> None:
    """A turn's K/V waiting beside the pool (preempted, or its parked table given up) goes to
    host memory with at most one chunk's copy made on the pool's device at a time, and comes
    back by chunks too, bit-exact: a whole context's gathered copy on the GPU ran a 24 GiB
    server out of memory."""
    pages = -(-n // 16)
    pool = _pool(2 * pages + 2)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(n)))
    src, dst = PagedSequence(), PagedSequence()
    assert pool.reserve(src, n) and pool.reserve(dst, n)
    whole = pool.gather(src.pages, 0, n).clone()
    with _IndexSizes() as seen:
        host = pool.to_host(src.pages, 0, n)
    assert host.device.type == "cpu" and host.dtype == pool.dtype
    assert torch.equal(host, whole)
    assert seen.tokens and max(seen.tokens) <= CHUNK_TOKENS and sum(seen.tokens) == n
    with _IndexSizes() as seen:
        pool.scatter(dst.pages, 0, host)
    assert max(seen.tokens) <= CHUNK_TOKENS and sum(seen.tokens) == n
    assert torch.equal(pool.gather(dst.pages, 0, n), whole)
    with pytest.raises(ValueError, match="need"):
        pool.gather(src.pages, 0, n, out=torch.empty(1, 2, n, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_spill_to_the_host_holds_one_chunk_on_the_gpu() -> None:
    """On a GPU: a 3,000-token spill to the host raises the device's peak by at most about
    one chunk's copy, and scatters back bit-exact."""
    geo = KVGeometry(28, 4, 128, 128, "bfloat16", "gqa")  # a 7B model's K/V, 57 KB a token
    n, page = 3000, 16
    pool = PagePool(geo, 2 * (n // page + 1) * page * geo.bytes_per_token, page_size=page,
                    device="cuda", dtype=torch.bfloat16)  # fmt: skip
    src, dst = PagedSequence(), PagedSequence()
    assert pool.reserve(src, n) and pool.reserve(dst, n)
    pool.kv.normal_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    host = pool.to_host(src.pages, 0, n)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - before
    assert host.device.type == "cpu"
    assert grew <= 2 * CHUNK_TOKENS * geo.bytes_per_token, grew  # a context is 12 x that
    pool.scatter(dst.pages, 0, host)
    assert torch.equal(pool.gather(dst.pages, 0, n).cpu(), host)
