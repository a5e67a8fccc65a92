"""Paged attention over an int8 page pool (degraded mode, `PagePool(kv_dtype="int8")`).

The simplest correct route: the layer's new K/V are quantized into the pages
(`PagePool.write_layer`), then the pages this step reads (every page of its block table) are
dequantized into a small dense block of the model's dtype, the block table is renumbered into
that block, and the reference path (gather + SDPA, `reference_paged`) runs over it. No Triton
kernel, no varlen FlashAttention and no CUDA graph reads an int8 pool (`BatchRunner` refuses to
capture one); its steps run eager.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtier.errors import KvtierError
from kvtier.paged.context import PagedContext
from kvtier.paged.quant import dequantize_kv
from kvtier.paged.reference import reference_paged


def _step_pages(ctx: PagedContext) -> tuple[torch.Tensor, PagedContext]:
    """The pages of this step's block table (ascending) and the context whose block table
    indexes them; made by the first layer on a device, reused by the others."""
    hit = ctx.__dict__.get("_int8")
    if hit is None:
        width = max(ctx.page_counts)
        table = ctx.block_table[: ctx.num_seqs, :width].long()
        used = torch.unique(table)
        local = torch.zeros(ctx.pool.num_pages, dtype=torch.long, device=table.device)
        local[used] = torch.arange(used.numel(), device=table.device)
        renumbered = local[table].to(ctx.block_table.dtype)
        hit = (
            used,
            dataclasses.replace(ctx, block_table=renumbered, backend="reference", decode_rows=None),
        )
        ctx.__dict__["_int8"] = hit
    return hit


def attend_int8(
    ctx: PagedContext,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Store `key`/`value` `[T, kv_heads, dim]` quantized, then causal attention of `q`
    `[T, heads, dim]` over the dequantized pages; returns `[T, heads, dim]`."""
    if ctx.capturing:
        raise KvtierError("a CUDA graph cannot record attention over an int8 page pool: run eager")
    pool = ctx.pool
    pool.write_layer(layer, key, value, ctx.slot_mapping)
    used, local = _step_pages(ctx)
    k8, v8, ks, vs = pool.storage(layer)
    if ks is None or vs is None:
        raise KvtierError("attend_int8 reads an int8 page pool; this one stores native K/V")
    k = dequantize_kv(k8.index_select(0, used), ks.index_select(0, used), q.dtype)
    v = dequantize_kv(v8.index_select(0, used), vs.index_select(0, used), q.dtype)
    return reference_paged(local, q, k, v, scale, sliding_window)
