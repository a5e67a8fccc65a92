"""PrefixPages, the index of shared prefix pages: a key names a page only while some page table
holds it unchanged, and the index holds nothing the garbage collector walks."""

from __future__ import annotations

import gc

from kvtier.geometry import KVGeometry
from kvtier.paged import PagedSequence, PagePool
from kvtier.server.pages.pageshare import PrefixPages, page_keys

GEO = KVGeometry(2, 2, 16, 16, "float32", "gqa")


def _pool() -> PagePool:
    return PagePool(GEO, 16 * 16 * GEO.bytes_per_token, page_size=16)


def _admit(
    pool: PagePool, index: PrefixPages, keys: list[bytes], shared: list[int]
) -> PagedSequence:
    seq = PagedSequence(pages=pool.share(shared), length=16 * len(shared))
    assert pool.reserve(seq, 16 * len(keys) - seq.length)
    index.register(keys, seq)
    return seq


def _leave(pool: PagePool, index: PrefixPages, seq: PagedSequence) -> None:
    index.drop(seq.pages)  # before the pages go, as the scheduler does
    pool.release(seq)


def test_a_key_lives_while_any_holder_of_its_page_runs() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    keys = page_keys("t", list(range(64)), 16, 4)
    first = _admit(pool, index, keys, [])
    pages = first.pages[:4]
    assert index.lookup(keys) == pages
    sharer = _admit(pool, index, keys[:3], index.lookup(keys[:3]))
    assert sharer.pages[:3] == pages[:3]
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
    pages = list(a.pages)
    _leave(pool, index, a)
    b = _admit(pool, index, new, [])  # the free list hands the same pages out again
    assert sorted(b.pages) == sorted(pages)
    assert index.lookup(old) == []
    assert index.lookup(new) == b.pages[:2]


def test_pages_about_to_be_written_lose_their_keys_unless_another_table_holds_them() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    keys = page_keys("t", list(range(64)), 16, 4)
    held = _admit(pool, index, keys, [])
    other = _admit(pool, index, keys[:1], index.lookup(keys[:1]))  # shares page 0
    index.drop(held.pages[0:])  # `held` will write from its first page on
    # page 0 is another table's too, unchanged there: still found; the rest are not
    assert index.lookup(keys) == held.pages[:1] == other.pages[:1]


def test_other_tenants_keys_differ() -> None:
    ids = list(range(32))
    assert set(page_keys("t", ids, 16, 2)).isdisjoint(page_keys("u", ids, 16, 2))


def test_the_collector_walks_nothing_of_the_index() -> None:
    pool = _pool()
    index = PrefixPages(pool)
    _admit(pool, index, page_keys("t", list(range(48)), 16, 3), [])
    _admit(pool, index, page_keys("t", list(range(48)), 16, 3), [])  # a second copy
    gc.collect()
    assert len(index) == 3
    for part in (index._page, index._key):
        assert part and not gc.is_tracked(part)
