"""The reference paged attention, on any device: each sequence's pages gathered, then SDPA with
a causal mask aligned to the end of the sequence (prefill, decode, mixed, GQA, sliding windows).
The other backends (kvtier.paged.attention) are checked against it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.errors import KvtierError
from kvtier.paged.context import PagedContext

# The bytes of one SDPA call's K and V copies in `_flash_lower_right` (its query heads' share
# of the context), beside the chunk's queries and output: what the GPU memory plan reserves
# for a long-context prefill (`prefill_attention_bytes`, kvtier.server.devices.memplan).
FLASH_KV_BYTES = 128 << 20


def reference_paged(
    ctx: PagedContext,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Gather each sequence's pages and run SDPA with an end-aligned causal mask."""
    if ctx.decode_only and sliding_window is None and ctx.num_seqs > 1:
        return _decode_batched(ctx, q, k_cache, v_cache, scale)
    outs = []
    start = 0
    for i, n_q in enumerate(ctx.query_lens):
        outs.append(
            _reference_one(ctx, i, q[start : start + n_q], k_cache, v_cache, scale, sliding_window)
        )
        start += n_q
    return torch.cat(outs, dim=0)


def _decode_batched(
    ctx: PagedContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """A decode-only step in one SDPA call: every sequence's pages gathered into one padded
    `[B, kv_heads, pages * page_size, dim]` block, the padding masked out. Where no kernel reads
    the page table (the CPU), one call for the batch costs less than one per sequence."""
    b, width = ctx.num_seqs, max(ctx.page_counts)
    table = ctx.block_table[:b, :width]  # entries past a row's pages: any valid page, masked
    k = k_cache[table].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, width * page, dim]
    v = v_cache[table].flatten(1, 2).transpose(1, 2)
    span = torch.arange(k.shape[2], device=q.device)
    mask = (span[None, :] < ctx.context_lens[:, None].to(span.dtype))[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, heads, 1, dim]
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )
    return o[:, :, 0, :]


def _reference_one(
    ctx: PagedContext,
    i: int,
    qi: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Sequence i's queries `[n_q, heads, dim]` over its gathered pages (end-aligned causal)."""
    heads, kv_heads = qi.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise KvtierError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    n_q, n_k = qi.shape[0], ctx.seq_lens[i]
    pages = ctx.block_table[i, : ctx.page_counts[i]]
    if sliding_window is None and n_q > 1 and qi.is_cuda:
        return _flash_lower_right(qi, k_cache, v_cache, pages, n_k, scale)
    k = k_cache.index_select(0, pages).flatten(0, 1)[:n_k]  # [n_k, kv_heads, dim]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:n_k]
    mask: Any = None
    if sliding_window is not None:
        q_pos = torch.arange(n_k - n_q, n_k, device=qi.device)[:, None]
        k_pos = torch.arange(n_k, device=qi.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
    elif n_q > 1:
        # causal, aligned to the end of the context (the CUDA path: `_flash_lower_right`)
        mask = causal_lower_right(n_q, n_k)
    o = F.scaled_dot_product_attention(
        qi.transpose(0, 1),
        k.transpose(0, 1).to(qi.dtype),
        v.transpose(0, 1).to(qi.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return o.transpose(0, 1)


def flash_heads(span: int, heads: int, head_dim: int, element: int, budget: int) -> int:
    """Query heads per SDPA call of `_flash_lower_right`: as many as keep the call's K and V
    buffers (`2 * heads * span * head_dim * element` bytes, `span` the context in whole pages)
    within `budget`, and at least one."""
    return max(1, min(heads, budget // max(1, 2 * span * head_dim * element)))


def prefill_attention_bytes(
    *,
    context_tokens: int,
    query_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element: int,
    page_size: int,
    budget: int = FLASH_KV_BYTES,
) -> int:
    """The most bytes `_flash_lower_right` holds at once beyond its inputs, for a prompt chunk
    of `query_tokens` over `context_tokens` (one layer of one sequence; layers and sequences
    run one after another). With `span` the context rounded up to whole pages and `c` the query
    heads per call (`flash_heads`):

        query_tokens * heads * head_dim * element     the result
      + 2 * c * span * head_dim * element             one call's K and V, repeated per head
      + c * query_tokens * (head_dim * element + 4)   its output and float32 log-sum-exp

    (for a pool whose dtype is the queries': else add one KV head's gather, `span * head_dim`
    of the pool's elements). `kv_heads` only checks the grouping: the repeat is per query head.
    """
    if heads % kv_heads:
        raise KvtierError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    span = -(-context_tokens // page_size) * page_size
    query_tokens = min(query_tokens, context_tokens)  # a chunk's tokens are in its context
    c = flash_heads(span, heads, head_dim, element, budget)
    return (
        query_tokens * heads * head_dim * element
        + 2 * c * span * head_dim * element
        + c * query_tokens * (head_dim * element + 4)
    )


def _flash_lower_right(
    qi: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    n_k: int,
    scale: float,
    budget: int = FLASH_KV_BYTES,
) -> torch.Tensor:
    """A prompt chunk `[n_q, heads, dim]` over its context (`n_k` tokens in `pages` of the
    caches `[pages, page_size, kv_heads, dim]`) with the end-aligned causal bias, through SDPA's
    flash kernel. That kernel takes the bias only for 4-D inputs with as many K/V heads as query
    heads: given 3-D inputs or grouped K/V heads, SDPA falls back to its math kernel in float32
    (on an H200, 1.5 ms a layer for a 512-token chunk over 3,000 tokens). So each query head
    gets its own copy of its KV head's K and V; those copies for all heads at once would be
    `2 * n_k * heads * dim` elements (348 MB for Qwen2-7B at 24K tokens, beside the gathered
    pages), so the heads go through in groups whose copies stay within `budget` bytes
    (`flash_heads`), each head's pages gathered straight into its copy. Every head's result
    is the one a single call for all heads gives. Peak bytes: `prefill_attention_bytes`."""
    n_q, heads, dim = qi.shape
    group = heads // k_cache.shape[2]
    span = pages.numel() * k_cache.shape[1]
    step = flash_heads(span, heads, dim, qi.element_size(), budget)
    mask = causal_lower_right(n_q, n_k)
    q4 = qi.transpose(0, 1)[None]  # [1, heads, n_q, dim]
    out = torch.empty_like(qi)
    for h0 in range(0, heads, step):
        h1 = min(heads, h0 + step)
        kk = _heads_kv(k_cache, pages, span, h0, h1, group, qi.dtype)[:, :n_k]
        vv = _heads_kv(v_cache, pages, span, h0, h1, group, qi.dtype)[:, :n_k]
        o = F.scaled_dot_product_attention(
            q4[:, h0:h1], kk[None], vv[None], attn_mask=mask, scale=scale
        )
        out[:, h0:h1].copy_(o[0].transpose(0, 1))
        del kk, vv, o  # freed before the next group's copies are made
    return out


def _heads_kv(
    cache: torch.Tensor,
    pages: torch.Tensor,
    span: int,
    h0: int,
    h1: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Query heads h0..h1's keys (or values) over `pages`, `[h1 - h0, span, dim]` in `dtype`:
    the first query head of each KV head gets its pages gathered into its row, the others of
    its group a copy of that row. A pool of another dtype is gathered one KV head at a time and
    cast on the copy."""
    n_pages, dim = pages.numel(), cache.shape[-1]
    out = torch.empty((h1 - h0, span, dim), dtype=dtype, device=cache.device)
    h = h0
    while h < h1:
        kv = h // group
        end = min(h1, (kv + 1) * group)
        row = out[h - h0]
        if cache.dtype == dtype:
            torch.index_select(cache[:, :, kv], 0, pages, out=row.view(n_pages, -1, dim))
        else:
            row.copy_(cache[:, :, kv].index_select(0, pages).flatten(0, 1))
        if end > h + 1:
            out[h - h0 + 1 : end - h0].copy_(row.expand(end - h - 1, span, dim))
        h = end
    return out
