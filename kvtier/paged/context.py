"""What every paged attention layer of one forward needs: the `PagedContext` (where each
sequence's tokens and pages are), set around the forward with `paged_context(ctx)` (a
contextvar) and read by the layers with `current_context()` (kvtier.paged.attention)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from kvtier.errors import ConfigError, KvtierError
from kvtier.paged.pool import PagePool

ATTN_NAME = "kvtier_paged"
BACKENDS = ("auto", "reference", "triton", "split", "rows", "varlen")


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
    # the rows' blocks (first row, rows; kvtier.paged.rowblocks): a prompt chunk's rows in
    # tiles for the prefill kernel, each decode token a block of one row. None: every row on
    # its own (the decode kernel alone). `prefill_tiles`: how many of the first blocks the
    # prefill kernel's grid covers (a CUDA graph's bucket fixes it), `tile_count` (int32 [1],
    # on the device) how many of them are this step's tiles (None: exactly `prefill_tiles`)
    row_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill_tiles: int = 0
    tile_count: torch.Tensor | None = None
    capturing: bool = False  # recorded in a CUDA graph: only the "rows" path may run
    # the decode rows of a mixed step, made once per forward (see `_decode_rows`)
    decode_rows: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
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
