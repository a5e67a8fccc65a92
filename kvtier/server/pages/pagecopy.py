"""K/V between a session's transformers Cache and the batch's page pool.

A restored prefix goes into the pages when its turn is admitted (`copy_in`; with paged L1
straight from its L2 slots, `PagePool.write_chunks`); the K/V a turn
computed (its prompt suffix and the fed reply tokens) comes back out when it ends or is
preempted (`copy_out`), and is appended to the session's Cache (`append_kv`), which the tiered
cache then commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.integrations.hf import KvtierCache
from kvtier.paged import PagedSequence, PagePool
from kvtier.paged.pool import to_device


def copy_in(pool: PagePool, kv: Any, seq: PagedSequence, start: int, n: int) -> None:
    """Tokens `[start, n)` of a transformers Cache into `seq`'s pages (an int8 pool quantizes
    them). A session whose L1 is one block (`SessionBuffers.block`) goes in one copy for every
    layer; other Caches layer by layer."""
    if n <= start:
        return
    block = _l1_block(kv)
    if block is not None:
        # [layer, k|v, 1, H, capacity, D] -> [layer, k|v, token, H, D], a view
        pool.scatter(seq.pages, start, block[:, :, 0, :, start:n].transpose(2, 3))
        return
    size = pool.page_size
    pages = torch.tensor(seq.pages, dtype=torch.long)
    host = (pages[:, None] * size + torch.arange(size)).flatten()[start:n]
    slots: dict[torch.device, torch.Tensor] = {}
    for i, layer in enumerate(kv.layers):
        dev = pool.storage(i)[0].device  # the layer's device (kvtier.placement)
        if dev not in slots:
            slots[dev] = to_device(host, dev)
        k = layer.keys[0, :, start:n].transpose(0, 1).to(dev)
        v = layer.values[0, :, start:n].transpose(0, 1).to(dev)
        pool.write_layer(i, k, v, slots[dev])


def _l1_block(kv: Any) -> torch.Tensor | None:
    """The one `[layer, k|v, 1, H, capacity, D]` tensor behind a kvtier session's Cache, else
    None (a DynamicCache, per-layer L1 tensors)."""
    bufs = getattr(getattr(kv, "owner", None), "bufs", None)
    block = getattr(bufs, "block", None) if bufs is not None and not bufs.released else None
    return block if isinstance(block, torch.Tensor) else None


def copy_out(pool: PagePool, seq: PagedSequence, start: int) -> torch.Tensor | None:
    """K/V of tokens `[start, seq.length)` from the pages as one `[layer, k|v, 1, kv_heads, n,
    head_dim]` tensor (a session's L1 block layout) on the pool's primary device, where the
    session's Cache lives: one gather for every layer.

    None from an int8 pool (degraded mode): the session's Cache never takes approximate K/V,
    so it keeps what it had and the turn's commit covers only that (the rest is recomputed,
    exactly once the pool is native again)."""
    end = seq.length
    if end <= start or pool.quantized:
        return None
    data = pool.gather(seq.pages, start, end)  # [layer, k|v, token, H, D] on pool.device
    return data.transpose(2, 3).unsqueeze(2)  # [layer, k|v, 1, H, token, D]


def append_kv(kv: Any, new: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append K/V to a transformers Cache: `new` is `copy_out`'s tensor, or one `(K, V)` pair
    of `[1, kv_heads, n, dim]` per layer.

    A kvtier session's Cache takes the tensor whole (`KvtierCache.extend`: one copy into its L1
    block); other Caches take `update()` per layer, last layer first: kvtier's cache times a
    multi-token forward from layer 0 to the last layer as a prefill (its cost model learns the
    prefill rate from it), and this copy is no prefill.
    """
    if isinstance(new, torch.Tensor):
        if isinstance(kv, KvtierCache):
            kv.extend(new)
            return
        new = [(new[i, 0], new[i, 1]) for i in range(new.shape[0])]
    for i in range(len(new) - 1, -1, -1):
        k, v = new[i]
        kv.update(k, v, i)
