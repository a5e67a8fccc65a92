"""CUDA graphs of the decode-only step, one per batch-size bucket.

An eager decode step of a transformers model launches a few hundred small kernels, and at a
batch of 64 the GPU waits on those launches more than on memory. A CUDA graph records the
launches of one step once and replays them as one. What makes that possible here:

- every input of a step lives in a `BatchRunner` buffer of fixed address (ids, positions, slot
  mapping, block table, lengths), rewritten before each replay;
- the Triton decode kernel's grid depends only on the batch size (each sequence cuts its own
  context into `num_splits` ranges), not on the lengths;
- no mask is built and nothing in the forward reads a value back to the host.

A batch of `b` sequences replays the graph of the smallest bucket `B >= b`; rows `b..B-1` are
padding: one token at position 0 whose K/V goes to a page kept out of the pool for it, and whose
logits are dropped. Mixed steps (prompt chunks) and batches above the largest bucket run eager.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.paged.attention import PagedContext, paged_context

if TYPE_CHECKING:
    from kvtier.paged.runner import BatchRunner

log = logging.getLogger(__name__)


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to `max_batch` (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    """The captured decode steps of one `BatchRunner` (CUDA only)."""

    def __init__(self, runner: BatchRunner, buckets: Sequence[int] | None = None) -> None:
        if runner.pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the page pool on a CUDA device")
        sizes = sorted(set(buckets or default_buckets(runner.max_batch)))
        if not sizes or sizes[0] < 1 or sizes[-1] > runner.max_batch:
            raise ValueError(f"graph buckets {sizes} must lie in 1..max_batch={runner.max_batch}")
        self.runner = runner
        self.buckets = sizes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def bucket(self, batch: int) -> int | None:
        """The captured bucket a batch of `batch` sequences replays; None: run eager."""
        i = bisect.bisect_left(self.buckets, batch)
        if i == len(self.buckets):
            return None
        size = self.buckets[i]
        return size if size in self._graphs else None

    def context(self, size: int) -> PagedContext:
        """The forward context of a bucket: views of the runner's fixed buffers."""
        r = self.runner
        return PagedContext(
            pool=r.pool,
            cu_seqlens_q=r.cu_seqlens_q[: size + 1],
            cu_seqlens_k=r.cu_seqlens_k[: size + 1],
            context_lens=r.context_lens[:size],
            slot_mapping=r.slot_mapping[:size],
            block_table=r.block_table[:size],
            query_lens=[1] * size,
            seq_lens=[r.max_seq_len] * size,
            page_counts=[r.max_pages] * size,
            backend="triton",
            num_splits=r.graph_splits(size),
        )

    def capture(self) -> list[int]:
        """Capture every bucket, largest first (they share one memory pool); the sizes captured.

        A bucket whose capture fails is left to the eager path, with a warning.
        """
        r = self.runner
        self._pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            r.fill_padding(0, size)
            ctx = self.context(size)
            try:
                side = torch.cuda.Stream(device=r.pool.device)
                side.wait_stream(torch.cuda.current_stream(r.pool.device))
                with torch.cuda.stream(side), torch.inference_mode(), paged_context(ctx):
                    for _ in range(2):  # first use: kernel selection, allocator warm-up
                        r.forward(size, logits_to_keep=0)
                torch.cuda.current_stream(r.pool.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    paged_context(ctx),
                    torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
                ):
                    logits = r.forward(size, logits_to_keep=0)
            except Exception as exc:  # a model the capture cannot take runs eager
                log.warning("CUDA graph of a %d-sequence decode step not captured: %s", size, exc)
                continue
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(r.pool.device)
        return self.captured

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured step of bucket `size`; its logits `[size, vocab]` (valid until the
        next replay)."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
