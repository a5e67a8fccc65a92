"""Full KV pages of restored prefixes, shared between the batch's running sequences.

Many sessions of one tenant start with the same long prompt (a system prompt, tool
definitions). When the batch scheduler admits a sequence, it copies its restored prefix's K/V
into pages; `PrefixPages` lets a later sequence take the pages of the same prefix from a
running sequence instead (`PagePool.share`: one more reference, no copy).

A page is found by a content key: a hash chain over the tenant and the token ids of the first
`(i + 1) * page_size` tokens (`page_keys`: the cache's chunk-key chain, a page per link). Equal keys
mean equal tokens from position 0, so equal K/V. The tenant is part of every key: sessions of
different tenants never share a page, so no tenant can learn from an admission's speed that
another one sent the same prefix.

Only FULL pages inside a sequence's restored prefix (`cached` tokens) are registered and
shared: the scheduler writes a sequence's pages only past its cached prefix, so a shared page is
never written, and no shared partial page (copy-on-write) ever arises.

A key is dropped when the last page table that holds its page lets it go (the scheduler calls
`drop` before it frees a table's pages, or writes a parked table's pages again), so a key never
names a freed page, nor one given to another sequence since, nor one written since.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.cache.keys import chain, namespace
from kvtier.paged import PagedSequence, PagePool

PAGE_NAMESPACE = b"kvtier-page"  # page keys never equal a chunk key of the cache


def page_keys(tenant: str, tokens: Sequence[int], page_size: int, pages: int) -> list[bytes]:
    """The content keys of the first `pages` full pages of `tokens` under `tenant`: the cache's
    chunk-key chain (`kvtier.cache.keys.chain`) with pages for chunks, in a namespace of its own
    for each tenant."""
    ns = namespace(PAGE_NAMESPACE, tenant)
    return [key for _, key in chain(tokens[: pages * page_size], page_size, ns)]


class PrefixPages:
    """Content key of a full prefix page -> the page, while some page table holds it.

    Two flat maps of bytes and ints (key -> page, page -> key): the garbage collector walks
    neither (dicts of atomic keys and values are untracked), where an entry object per holder
    and page made it walk about 8,000 of them per collection in the 64-session fleet (pages of
    16 tokens). A key names one page: when two copies of one prefix are held (the second
    admitted while no holder of the first ran), the first registered stays findable until its
    last holder lets it go.
    """

    def __init__(self, pool: PagePool | None = None) -> None:
        self.pool = pool  # the pool the pages belong to
        self._page: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._page)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages for the longest run of leading `keys` that some page table holds."""
        pages: list[int] = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, keys: Sequence[bytes], table: PagedSequence) -> None:
        """The first `len(keys)` pages of `table` hold the K/V of the prefix those keys name."""
        for key, page in zip(keys, table.pages, strict=False):
            if self._page.setdefault(key, page) == page:
                self._key[page] = key

    def drop(self, pages: Sequence[int]) -> None:
        """`pages` are about to be freed or written by their holder: forget the key of each one
        that no other page table holds. Call it before every `release` of a table and before
        a table is written below what its keys cover."""
        assert self.pool is not None
        for page in pages:
            if self.pool.refcount(page) > 1:
                continue  # another table holds it, unchanged
            key = self._key.pop(page, None)
            if key is not None and self._page.get(key) == page:
                del self._page[key]
