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
from transformers.cache_utils import Cache, CacheLayerMixin

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


class PagedLayer(CacheLayerMixin):
    """One attention layer's K/V, in the pages of the owning `PagedCache`'s table."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    keys = _Gathered(0)  # type: ignore[assignment]
    values = _Gathered(1)  # type: ignore[assignment]

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = True
        self.device = cache.pool.storage(layer_idx)[0].device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the pool exists before the first forward

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V, `[1, kv_heads, tokens, head_dim]` each, in the model's dtype."""
        c = self.cache
        k, v = c.pool.gather_layer(c.table.pages, 0, c.lengths[self.layer_idx], self.layer_idx)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise ValueError(
                f"a kvtier session holds one sequence; got batch size {key_states.shape[0]}. "
                "Run one session per call, or batch sessions with kvtier.paged.BatchRunner."
            )
        c, i = self.cache, self.layer_idx
        start = c.lengths[i]
        end = start + key_states.shape[-2]
        if end > len(c.table.pages) * c.pool.page_size:
            c.owner.reserve_pages(c, end)
        slots = c.pool.slots(c.table.pages, start, end, self.device)
        # [1, H, n, D] -> [n, H, D], the pool's token-major layout
        c.pool.write_layer(i, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), slots)
        c.lengths[i] = end
        c.table.length = min(c.lengths)
        return self.gathered()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.lengths[self.layer_idx]

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        n = self.get_seq_length()
        keep = n + tokens_to_remove if tokens_to_remove < 0 else min(n, tokens_to_remove)
        self.cache.lengths[self.layer_idx] = max(0, keep)
        self.cache.table.length = min(self.cache.lengths)

    def reset(self) -> None:
        self.crop(0)

    def offload(self) -> None:  # tiering is kvtier's job, not transformers' offloading
        return None

    def prefetch(self) -> None:
        return None


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
