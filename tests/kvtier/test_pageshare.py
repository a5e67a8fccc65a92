"""PrefixPages, the index of shared prefix pages: a key names a page only while a sequence that
registered it holds it, and the index holds nothing the garbage collector walks."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from kvtier.geometry import KVGeometry
from kvtier.paged import PagedSequence, PagePool
from kvtier.server.pageshare import PrefixPages, page_keys

GEO = KVGeometry(2, 2, 16, 16, "float32", "gqa")


@dataclass(eq=False)
class _Holder:
    """What the scheduler's sequence offers the index: its page table while it runs."""

    paged: PagedSequence | None = None


def _pool() -> PagePool:
    return PagePool(GEO, 16 * 16 * GEO.bytes_per_token, page_size=16)


def _admit(pool: PagePool, index: PrefixPages, keys: list[bytes], shared: list[int]) -> _Holder:
    seq = PagedSequence(pages=pool.share(shared), length=16 * len(shared))
    assert pool.reserve(seq, 16 * len(keys) - seq.length)
    holder = _Holder(seq)
    index.register(holder, keys, seq)
    return holder


def _leave(pool: PagePool, index: PrefixPages, holder: _Holder) -> None:
    index.forget(holder)  # before the pages go, as the scheduler does
    assert holder.paged is not None
    pool.release(holder.paged)
    holder.paged = None


def test_a_key_lives_while_any_holder_of_its_page_runs() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    keys = page_keys("t", list(range(64)), 16, 4)
    first = _admit(pool, index, keys, [])
    assert first.paged is not None
    pages = first.paged.pages[:4]
    assert index.lookup(keys) == pages
    sharer = _admit(pool, index, keys[:3], index.lookup(keys[:3]))
    assert sharer.paged is not None and sharer.paged.pages[:3] == pages[:3]
    _leave(pool, index, first)
    # the sharer still holds the first three; the fourth went with the first holder
    assert index.lookup(keys) == pages[:3]
    _leave(pool, index, sharer)
    assert index.lookup(keys) == [] and len(index) == 0


def test_a_freed_page_given_to_another_prefix_is_never_found_by_the_old_key() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    old = page_keys("t", list(range(32)), 16, 2)
    new = page_keys("t", list(range(100, 132)), 16, 2)
    a = _admit(pool, index, old, [])
    assert a.paged is not None
    pages = list(a.paged.pages)
    _leave(pool, index, a)
    b = _admit(pool, index, new, [])  # the free list hands the same pages out again
    assert b.paged is not None and sorted(b.paged.pages) == sorted(pages)
    assert index.lookup(old) == []
    assert index.lookup(new) == b.paged.pages[:2]


def test_other_tenants_keys_differ() -> None:
    ids = list(range(32))
    assert set(page_keys("t", ids, 16, 2)).isdisjoint(page_keys("u", ids, 16, 2))


def test_the_collector_walks_nothing_of_the_index() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    holders = [_admit(pool, index, page_keys("t", list(range(48)), 16, 3), [])]
    holders.append(_admit(pool, index, page_keys("t", list(range(48)), 16, 3), []))
    gc.collect()
    assert len(index) == 3
    for part in (index._page, index._key, index._owned):
        assert part and not gc.is_tracked(part)
