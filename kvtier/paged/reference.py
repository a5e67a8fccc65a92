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
    k = k_cache.index_select(0, pages).flatten(0, 1)[:n_k]  # [n_k, kv_heads, dim]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:n_k]
    mask: Any = None
    if sliding_window is not None:
        q_pos = torch.arange(n_k - n_q, n_k, device=qi.device)[:, None]
        k_pos = torch.arange(n_k, device=qi.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
    elif n_q > 1:
        # causal, aligned to the end of the context: a bias SDPA's flash and memory-efficient
        # kernels take as such, where a boolean mask would send it to the math kernel
        mask = causal_lower_right(n_q, n_k)
        if qi.is_cuda:
            return _flash_lower_right(qi, k, v, mask, scale)
    o = F.scaled_dot_product_attention(
        qi.transpose(0, 1),
        k.transpose(0, 1).to(qi.dtype),
        v.transpose(0, 1).to(qi.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return o.transpose(0, 1)


def _flash_lower_right(
    qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float
) -> torch.Tensor:
    """A prompt chunk `[n_q, heads, dim]` over its context `[n_k, kv_heads, dim]` with the
    end-aligned causal bias, through SDPA's flash kernel. That kernel takes the bias only for
    4-D inputs with as many K/V heads as query heads: given 3-D inputs or grouped K/V heads, SDPA
    falls back to its math kernel in float32 (on an H200, 1.5 ms a layer for a 512-token chunk
    over 3,000 tokens). So the K/V heads are repeated for their query groups here."""
    group = qi.shape[1] // k.shape[1]
    kk = k.transpose(0, 1).to(qi.dtype)
    vv = v.transpose(0, 1).to(qi.dtype)
    if group > 1:
        kk = kk.repeat_interleave(group, dim=0)
        vv = vv.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(
        qi.transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask, scale=scale
    )
    return o[0].transpose(0, 1)
