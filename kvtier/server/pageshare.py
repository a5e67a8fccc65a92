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

A key is dropped when the last running sequence that holds its page leaves the pool (the
scheduler calls `forget` before it frees a sequence's pages), so a key never names a freed
page, nor one given to another sequence since.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    """Content key of a full prefix page -> the page, while a running sequence that registered
    it holds it.

    Two flat maps of bytes and ints (key -> page, page -> key) and a count per holder: the
    garbage collector walks none of them (dicts of atomic keys and values are untracked), where
    an entry object per holder and page made it walk about 8,000 of them per collection in the
    64-session fleet (pages of 16 tokens). A key names one page: when two copies of one prefix
    run (the second admitted while no holder of the first ran), the first registered stays
    findable until its last holder leaves.
    """

    def __init__(self, pool: PagePool | None = None) -> None:
        self.pool = pool  # the pool the pages belong to
        self._page: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._owned: dict[int, int] = {}  # id(holder) -> its registered (leading) pages

    def __len__(self) -> int:
        return len(self._page)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages for the longest run of leading `keys` that some running sequence holds."""
        pages: list[int] = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, owner: Any, keys: Sequence[bytes], table: PagedSequence) -> None:
        """`owner` holds `table`, whose first `len(keys)` pages hold its prefix's K/V."""
        self.forget(owner)
        for key, page in zip(keys, table.pages, strict=False):
            if self._page.setdefault(key, page) == page:
                self._key[page] = key
        if keys:
            self._owned[id(owner)] = len(keys)

    def forget(self, owner: Any) -> None:
        """`owner` is about to leave the pool (its `paged` still set): drop the keys of its
        registered pages that no other sequence holds."""
        n = self._owned.pop(id(owner), 0)
        table = owner.paged
        if not n or table is None:
            return
        assert self.pool is not None
        for page in table.pages[:n]:
            if self.pool.refcount(page) > 1:
                continue  # a sharer holds it still
            key = self._key.pop(page, None)
            if key is not None and self._page.get(key) == page:
                del self._page[key]
