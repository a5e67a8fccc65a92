"""A transformers `Cache` over pages of a `PagePool`: what `Session.restore(ids, pool=pool)`
returns.

The session's K/V lives in the pool's pages (its page table, a `PagedSequence`), not in a
buffer of its own. Each layer's `update` writes the new tokens into the table's pages (more
pages are reserved first, through the owner, which may free other idle sessions' pages) and
returns that layer's whole K/V gathered from the pages as `[1, kv_heads, tokens, head_dim]`, so
any attention implementation of transformers reads it. A batch of your own reads the same pages
in place (`kvtier.paged.BatchRunner`); this view is for one sequence driven by `generate` or a
loop of forwards.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache

from kvtier.integrations.hf import ListedLayer
from kvtier.paged.pool import PagedSequence, PagePool


class PageOwner(Protocol):
    """Who reserves the pages (the tiered cache, under its lock)."""

    def reserve_pages(self, cache: PagedCache, tokens: int) -> None: ...


class _Gathered:
    """A `PagedLayer`'s `keys` (plane 0) or `values` (plane 1), gathered from the pages when
    read (attention takes `update`'s return; these are for code that inspects a layer)."""

    def __init__(self, plane: int) -> None:
        self.plane = plane

    def __get__(self, layer: PagedLayer | None, kind: type | None = None) -> Any:
        return self if layer is None else layer.gathered()[self.plane]

    def __set__(self, layer: PagedLayer, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a paged layer's K/V live in the pool's pages; use update()")


class PagedLayer(ListedLayer):
    """One attention layer's K/V, in the pages of the owning `PagedCache`'s table."""

    keys = _Gathered(0)  # type: ignore[assignment]
    values = _Gathered(1)  # type: ignore[assignment]

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = True
        self.device = cache.pool.storage(layer_idx)[0].device

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V, `[1, kv_heads, tokens, head_dim]` each, in the model's dtype."""
        c = self.cache
        k, v = c.pool.gather_layer(c.table.pages, 0, c.lengths[self.layer_idx], self.layer_idx)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._span(key_states)
        c, i = self.cache, self.layer_idx
        if end > len(c.table.pages) * c.pool.page_size:
            c.owner.reserve_pages(c, end)
        slots = c.pool.slots(c.table.pages, start, end, self.device)
        # [1, H, n, D] -> [n, H, D], the pool's token-major layout
        c.pool.write_layer(i, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), slots)
        c.lengths[i] = end
        self._resized()
        return self.gathered()

    def _lengths(self) -> list[int]:
        return self.cache.lengths

    def _resized(self) -> None:
        self.cache.table.length = min(self.cache.lengths)


class PagedCache(Cache):
    """A transformers `Cache` over one sequence's page table in `pool`, its first `length`
    tokens' K/V written. Pages past those are reserved through `owner` as forwards need them."""

    def __init__(self, owner: PageOwner, pool: PagePool, table: PagedSequence) -> None:
        self.owner = owner
        self.pool = pool
        self.table = table
        self.lengths = [table.length] * pool.geometry.num_layers
        layers = [PagedLayer(self, i) for i in range(pool.geometry.num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]
