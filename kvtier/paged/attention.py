"""Paged attention for transformers models: the "kvtier_paged" attention implementation.

The model is called with ONE flattened batch (`input_ids` `[1, T]`, the new tokens of every
sequence back to back, `position_ids` `[1, T]`, no cache). transformers calls the registered
attention function once per layer with `query` `[1, heads, T, dim]` and `key`/`value`
`[1, kv_heads, T, dim]` (already rotated). The function:

1. writes the new K/V into the page pool at each token's slot (`slot_mapping`);
2. computes causal attention of each sequence's queries over that sequence's pages.

Everything the layer needs beyond q/k/v comes from a `PagedContext` that the caller sets around
the forward with `paged_context(ctx)` (a contextvar). No dense mask is built: transformers builds
masks only for implementations registered in its `AttentionMaskInterface`, and this one is not.

Backends (`PagedContext.backend`):
- "reference": any device. Gathers each sequence's pages and calls SDPA with an explicit causal
  mask aligned to the end of the sequence. Handles prefill, decode, mixed, GQA, sliding windows.
- "triton": CUDA, decode-only batches (one query per sequence): a flash-decoding kernel over the
  block table (`kvtier.paged.triton_decode`).
- "split": CUDA, mixed batches: the decode rows through the Triton kernel in one call, each
  prefilling sequence through SDPA over its gathered pages.
- "rows": CUDA (or the CPU, through a slow per-row reference for tests): every new token, decode
  or prompt chunk, is one row attending over its sequence's pages up to its own position
  (`PagedContext.row_seq`, `row_lens`): decode rows through the Triton decode kernel, prompt
  chunks in tiles through the Triton prefill kernel (`PagedContext.row_blocks`). Two kernel
  calls for any step, with grids fixed by the number of tokens: what the CUDA graphs of
  `kvtier.paged.graphs` record.
- "varlen": CUDA, `torch.nn.attention.varlen.varlen_attn` with `block_table=` where the installed
  torch has it; handles mixed prefill/decode batches. It runs FlashAttention 2, whose paged KV
  needs a page size of 256.
- "auto": varlen where available and the page size is 256, else on CUDA with Triton: triton for
  decode-only batches and split for mixed ones; else reference. (CUDA graphs record "rows".)
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.errors import KvtierError
from kvtier.paged.context import (
    ATTN_NAME,
    PagedContext,
    current_context,
)
from kvtier.paged.pool import to_device
from kvtier.paged.reference import _reference_one, reference_paged

VARLEN_PAGE = 256  # FlashAttention 2's paged KV takes page sizes that are multiples of this


@functools.cache
def varlen_block_table_supported() -> bool:
    """Whether the installed torch has `varlen_attn` with a `block_table=` argument."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    fn = getattr(varlen, "varlen_attn", None)
    return fn is not None and "block_table" in inspect.signature(fn).parameters


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write K/V into the pool, attend over the pages.

    Returns `[1, T, heads, dim]`, as transformers' own implementations do.
    """
    ctx = current_context()
    if query.device != ctx.slot_mapping.device:  # a layer on another device (kvtier.placement)
        from kvtier.paged.sharded import context_on

        ctx = context_on(ctx, query.device)
    if query.shape[0] != 1:
        raise KvtierError(
            f"paged attention takes one flattened batch (batch dim 1), got {query.shape[0]}"
        )
    if dropout:
        raise KvtierError("paged attention is for inference: call the model in eval mode")
    if kwargs.get("softcap") is not None:
        raise KvtierError("paged attention does not implement logit softcapping")
    layer = int(getattr(module, "layer_idx"))  # noqa: B009  (set by every transformers attention)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, heads, dim]
    if ctx.pool.quantized:  # degraded mode's int8 pages: the reference path over them
        from kvtier.paged.int8 import attend_int8

        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        return attend_int8(ctx, layer, q, k, v, scale, sliding_window).unsqueeze(0), None
    k_cache, v_cache = ctx.pool.layer_cache(layer)
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping)
    out = attend(ctx, q, k_cache, v_cache, scale, sliding_window)
    return out.unsqueeze(0), None


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' `[T, kv_heads, dim]` K/V at their flat slots of one layer's pages."""
    slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def attend(
    ctx: PagedContext,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `q` `[T, heads, dim]` over the pages; returns `[T, heads, dim]`."""
    backend = ctx.backend
    cuda = q.is_cuda and sliding_window is None
    if ctx.capturing and (sliding_window is not None or backend != "rows"):
        raise KvtierError(
            "a CUDA graph records only the 'rows' attention path, which has no sliding window: "
            "this model's steps run eager"
        )
    if backend == "rows" and not (q.is_cuda and _triton_available()) and not ctx.capturing:
        if sliding_window is not None:
            backend = "reference"
        else:
            return rows_reference(ctx, q, k_cache, v_cache, scale)
    if backend == "auto":
        # torch's varlen_attn runs FlashAttention 2: fp16/bf16 only, paged KV in pages of 256.
        flash = q.dtype in (torch.float16, torch.bfloat16) and k_cache.shape[1] % VARLEN_PAGE == 0
        if cuda and flash and varlen_block_table_supported():
            backend = "varlen"
        elif cuda and _triton_available():
            backend = "triton" if ctx.decode_only else "split"
        else:
            backend = "reference"
    # Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors, for tests.
    interpreted = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    interpreted = interpreted or (
        backend in ("split", "rows") and os.environ.get("TRITON_INTERPRET") == "1"
    )
    if backend in ("triton", "split", "rows", "varlen") and not (
        cuda or (interpreted and sliding_window is None)
    ):
        raise KvtierError(
            f"paged attention backend {backend!r} needs CUDA tensors and no sliding window; "
            "use 'reference' or 'auto'"
        )
    if backend == "triton":
        if not ctx.decode_only:
            raise KvtierError("the triton paged backend handles decode-only batches; use 'auto'")
        from kvtier.paged.triton_decode import paged_decode

        return paged_decode(
            q,
            k_cache,
            v_cache,
            ctx.block_table,
            ctx.context_lens,
            scale,
            max_len=max(ctx.seq_lens),
            num_splits=ctx.num_splits,
        )
    if backend == "rows":
        return rows_paged(ctx, q, k_cache, v_cache, scale)
    if backend == "varlen":
        return varlen_paged(ctx, q, k_cache, v_cache, scale)
    if backend == "split":
        return split_paged(ctx, q, k_cache, v_cache, scale)
    return reference_paged(ctx, q, k_cache, v_cache, scale, sliding_window)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(ctx: PagedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if ctx.row_seq is None or ctx.row_lens is None or ctx.row_table is None:
        raise KvtierError(
            "the 'rows' paged backend needs the step's per-token rows: run the model through "
            "kvtier.paged.BatchRunner, which sets them"
        )
    return ctx.row_seq, ctx.row_lens, ctx.row_table


def rows_paged(
    ctx: PagedContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of every new token, decode or prompt chunk, over its sequence's pages
    up to its own position: the decode rows through the decode kernel
    (`kvtier.paged.triton_decode.paged_decode`), one program per row, and the prompt chunks'
    rows (when `ctx.row_blocks` cuts them into tiles) through the prefill kernel
    (`kvtier.paged.triton_prefill.paged_prefill`), one program per tile and head."""
    from kvtier.paged.triton_decode import paged_decode

    row_seq, row_lens, table = _rows(ctx)
    out = paged_decode(
        q,
        k_cache,
        v_cache,
        table,
        row_lens,
        scale,
        max_len=max(ctx.seq_lens),
        num_splits=ctx.num_splits,
        row_seq=row_seq,
        blocks=ctx.row_blocks,
    )
    if ctx.row_blocks is not None and ctx.prefill_tiles > 0:
        from kvtier.paged.triton_prefill import paged_prefill

        paged_prefill(
            q, k_cache, v_cache, table, row_lens, row_seq, ctx.row_blocks, ctx.prefill_tiles,
            scale, out, count=ctx.tile_count,
        )  # fmt: skip
    return out


def rows_reference(
    ctx: PagedContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """What `rows_paged` computes, one SDPA call per row (the CPU, tests)."""
    row_seq, row_lens, table = _rows(ctx)
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for r, (s, n) in enumerate(zip(row_seq.tolist(), row_lens.tolist(), strict=True)):
        pages = table[s, : -(-n // page)].long()
        k = k_cache.index_select(0, pages).flatten(0, 1)[:n].transpose(0, 1)
        v = v_cache.index_select(0, pages).flatten(0, 1)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[r][:, None, :],
            k.to(q.dtype),
            v.to(q.dtype),
            scale=scale,
            enable_gqa=q.shape[1] != k_cache.shape[2],
        )
        out[r] = o[:, 0, :]
    return out


def split_paged(
    ctx: PagedContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """A mixed step on CUDA: the decode rows through the Triton kernel in one call, each
    prefilling sequence through SDPA over its gathered pages (prefill is bound by its matrix
    products, not by the gather)."""
    from kvtier.paged.triton_decode import paged_decode

    decode, rows, table, lens = _decode_rows(ctx)
    out = torch.empty_like(q)
    if decode:
        max_len = max(ctx.seq_lens[i] for i in decode)
        dec = paged_decode(
            q.index_select(0, rows), k_cache, v_cache, table, lens, scale, max_len=max_len
        )
        out.index_copy_(0, rows, dec)
    start = 0
    for i, n_q in enumerate(ctx.query_lens):
        if n_q > 1:
            out[start : start + n_q] = _reference_one(
                ctx, i, q[start : start + n_q], k_cache, v_cache, scale
            )
        start += n_q
    return out


def _decode_rows(
    ctx: PagedContext,
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences of this step with one query token, their rows in the flattened batch,
    page tables and lengths on the device; made by the first layer, reused by the rest."""
    if ctx.decode_rows is None:
        starts = [0]
        for n in ctx.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(ctx.query_lens) if n == 1]
        device = ctx.block_table.device
        index = to_device(torch.tensor(decode, dtype=torch.long), device)
        rows = to_device(torch.tensor([starts[i] for i in decode], dtype=torch.long), device)
        ctx.decode_rows = (
            decode,
            rows,
            ctx.block_table.index_select(0, index),
            ctx.context_lens.index_select(0, index),
        )
    return ctx.decode_rows


def varlen_paged(
    ctx: PagedContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """torch's varlen flash attention reading K/V through the block table (causal, GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    max_q = max(ctx.query_lens)
    max_k = max(ctx.seq_lens)
    out = varlen_attn(
        q,
        k_cache,
        v_cache,
        ctx.cu_seqlens_q,
        ctx.cu_seqlens_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=q.shape[1] != k_cache.shape[2],
        seqused_k=ctx.context_lens,
        block_table=ctx.block_table[: ctx.num_seqs],
    )
    assert isinstance(out, torch.Tensor)
    return out


def register() -> str:
    """Register "kvtier_paged" in transformers' `AttentionInterface` (idempotent); its name.

    No mask function is registered on purpose: transformers' mask builders return None for an
    implementation missing from `AttentionMaskInterface`, so no dense mask is ever made.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return ATTN_NAME
