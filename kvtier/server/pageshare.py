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

An entry is valid while its holder still runs with the same page table (`owner.paged is
table`) and that table still has the page at that position; stale entries are dropped when
met. A key keeps every running holder of its page, so the page stays findable while any of
them runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.cache.keys import chain, namespace
from kvtier.paged import PagedSequence

PAGE_NAMESPACE = b"kvtier-page"  # page keys never equal a chunk key of the cache


def page_keys(tenant: str, tokens: Sequence[int], page_size: int, pages: int) -> list[bytes]:
    """The content keys of the first `pages` full pages of `tokens` under `tenant`: the cache's
    chunk-key chain (`kvtier.cache.keys.chain`) with pages for chunks, in a namespace of its own
    for each tenant."""
    ns = namespace(PAGE_NAMESPACE, tenant)
    return [key for _, key in chain(tokens[: pages * page_size], page_size, ns)]


@dataclass(eq=False)
class _Entry:
    owner: Any  # the scheduler's sequence; its `paged` is its page table while it runs
    table: PagedSequence
    index: int  # the page's position in the table
    page: int


class PrefixPages:
    """Content key of a full prefix page -> the running sequences that hold it."""

    def __init__(self) -> None:
        self._index: dict[bytes, list[_Entry]] = {}
        self._owned: dict[Any, list[bytes]] = {}  # owner -> the keys it registered

    def __len__(self) -> int:
        return len(self._index)

    def clear(self) -> None:
        self._index.clear()
        self._owned.clear()

    def lookup(self, keys: Sequence[bytes], running: Sequence[Any]) -> list[int]:
        """Pages for the longest run of leading `keys` that some running sequence holds."""
        alive = {id(s) for s in running}
        pages: list[int] = []
        for key in keys:
            entries = self._index.get(key)
            found = None
            while entries:
                e = entries[-1]  # the newest holder first
                if (
                    id(e.owner) in alive
                    and e.owner.paged is e.table
                    and e.index < len(e.table.pages)
                    and e.table.pages[e.index] == e.page
                ):
                    found = e.page
                    break
                entries.pop()  # stale: its holder left, or was moved out of the pool
            if found is None:
                self._index.pop(key, None)
                break
            pages.append(found)
        return pages

    def register(self, owner: Any, keys: Sequence[bytes], table: PagedSequence) -> None:
        """`owner` holds `table`, whose first `len(keys)` pages hold its prefix's K/V."""
        self.forget(owner)
        for i, key in enumerate(keys):
            self._index.setdefault(key, []).append(_Entry(owner, table, i, table.pages[i]))
        if keys:
            self._owned[owner] = list(keys)

    def forget(self, owner: Any) -> None:
        """`owner` leaves the pool: drop its entries (others' entries for the key stay)."""
        for key in self._owned.pop(owner, ()):
            entries = self._index.get(key)
            if entries is None:
                continue
            entries[:] = [e for e in entries if e.owner is not owner]
            if not entries:
                del self._index[key]
