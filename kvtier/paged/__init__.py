"""Paged KV cache and batched decoding: one page pool, one forward for every active sequence.

- `pool`: `PagePool` (preallocated pages, free list, refcounts, copy-on-write, chunk helpers)
- `attention`: the "kvtier_paged" transformers attention function and its `PagedContext`
- `runner`: `BatchRunner`, one flattened forward per step over mixed prefill and decode
- `triton_decode`: the CUDA flash-decoding kernel (imported only on CUDA)

See docs/paged.md.
"""

from kvtier.paged.attention import register
from kvtier.paged.context import ATTN_NAME, PagedContext, paged_context
from kvtier.paged.pool import CHUNK_TOKENS, PagedSequence, PagePool, PoolExhausted
from kvtier.paged.runner import BatchRunner, Feed, SeqInput

__all__ = [
    "ATTN_NAME",
    "CHUNK_TOKENS",
    "BatchRunner",
    "Feed",
    "PagePool",
    "PagedContext",
    "PagedSequence",
    "PoolExhausted",
    "SeqInput",
    "paged_context",
    "register",
]
