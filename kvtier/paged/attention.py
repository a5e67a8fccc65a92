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
  or prompt chunk, is one row of the Triton kernel attending over its sequence's pages up to its
  own position (`PagedContext.row_seq`, `row_lens`). One kernel call for any step, with a grid
  fixed by the number of tokens: what the CUDA graphs of `kvtier.paged.graphs` record.
- "varlen": CUDA, `torch.nn.attention.varlen.varlen_attn` with `block_table=` where the installed
  torch has it; handles mixed prefill/decode batches. It runs FlashAttention 2, whose paged KV
  needs a page size of 256.
- "auto": varlen where available and the page size is 256, else on CUDA with Triton: triton for
  decode-only batches and split for mixed ones; else reference. (CUDA graphs record "rows".)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.errors import ConfigError, KvtierError
from kvtier.paged.pool import PagePool, to_device

ATTN_NAME = "kvtier_paged"
BACKENDS = ("auto", "reference", "triton", "split", "rows", "varlen")
VARLEN_PAGE = 256  # FlashAttention 2's paged KV takes page sizes that are multiples of this


@dataclass
class PagedContext:
    """What every attention layer of one forward needs to find its sequences in the pool.

    Device tensors (on the pool's device):
      cu_seqlens_q  int32 [B + 1]  query offsets of each sequence in the flattened batch
      cu_seqlens_k  int32 [B + 1]  running sum of context_lens (what varlen kernels take)
      context_lens  int32 [B]      tokens of each sequence after this step (old + new)
      slot_mapping  int64 [T]      flat slot (page * page_size + offset) of every new token
      block_table   int32 [B, max_pages]  each sequence's page table, padded
    Host copies (Python ints) drive the reference path without device syncs.
    """

    pool: PagePool
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    page_counts: list[int]
    backend: str = "auto"
    # Triton decode splits per sequence; None: chosen from the batch (a CUDA graph fixes it)
    num_splits: int | None = None
    # the "rows" backend: per new token its block-table row and its context (position + 1),
    # and the whole table (its last row is the padding row of graph steps)
    row_seq: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    row_table: torch.Tensor | None = None
    # the rows' blocks (first row, rows; kvtier.paged.rowblocks): a prompt chunk's rows read
    # their K/V together. None: every row on its own
    row_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    capturing: bool = False  # recorded in a CUDA graph: only the "rows" path may run
    # the decode rows of a mixed step, made once per forward (see `_decode_rows`)
    _rows: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


_CONTEXT: ContextVar[PagedContext | None] = ContextVar("kvtier_paged_context", default=None)


@contextlib.contextmanager
def paged_context(ctx: PagedContext) -> Iterator[PagedContext]:
    """Set the forward context for the forward run inside the `with` block."""
    if ctx.backend not in BACKENDS:
        raise ConfigError(f"paged attention backend {ctx.backend!r} is not one of {BACKENDS}")
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current_context() -> PagedContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise KvtierError(
            f"attention implementation {ATTN_NAME!r} was called outside a paged forward: run the "
            "model through kvtier.paged.BatchRunner, or set a PagedContext with paged_context()"
        )
    return ctx


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
    """Every new token one row of the Triton kernel: causal attention for decode tokens and
    prompt chunks alike, in one call (see `kvtier.paged.triton_decode.paged_decode`)."""
    from kvtier.paged.triton_decode import paged_decode

    row_seq, row_lens, table = _rows(ctx)
    return paged_decode(
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
    if ctx._rows is None:
        starts = [0]
        for n in ctx.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(ctx.query_lens) if n == 1]
        device = ctx.block_table.device
        index = to_device(torch.tensor(decode, dtype=torch.long), device)
        rows = to_device(torch.tensor([starts[i] for i in decode], dtype=torch.long), device)
        ctx._rows = (
            decode,
            rows,
            ctx.block_table.index_select(0, index),
            ctx.context_lens.index_select(0, index),
        )
    return ctx._rows


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
