"""CUDA graphs of the batched step, one per bucket of new tokens.

An eager step of a transformers model launches a couple of thousand small kernels, and at a
batch of 64 the GPU waits on those launches more than on memory. A CUDA graph records the
launches of one step once and replays them as one. What makes that possible here:

- every input of a step lives in a `BatchRunner` buffer of fixed address (ids, positions, slot
  mapping, per-token rows, block table, lengths, last-token indexes), rewritten before a replay;
- attention is the "rows" backend: every new token, decode or prompt chunk, is one row
  attending over its sequence's pages up to its own position, decode rows one program each of
  the Triton decode kernel, prompt chunks in tiles of the Triton prefill kernel. The grids
  depend only on the number of tokens (each decode row cuts its own context into `num_splits`
  ranges; the prefill grid has `rowblocks.max_tiles` of the bucket, the unused ones returning
  at once), so one graph serves any mix of decode tokens and prompt chunks of that many tokens;
- no mask is built and nothing in the forward reads a value back to the host.

With `decode_graphs`, every bucket of at most `max_batch` tokens gets a second graph for steps
with no prompt rows: the decode kernel alone, one program per row (no row blocks, no prefill
launch). A step that is all decode replays that graph; any step with a prompt chunk the "rows"
one.

A step of `T` new tokens from `b` sequences replays the graph of the smallest bucket `B >= T`:
tokens `T..B-1` are padding (position 0, K/V written to a page kept out of the pool for them)
and so are sequence rows `b..min(B, max_batch)-1`, whose logits are dropped. A step above the
largest bucket, or of a model with sliding-window layers (the kernel has no window), runs eager.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.paged.context import PagedContext, paged_context
from kvtier.paged.rowblocks import max_tiles

if TYPE_CHECKING:
    from kvtier.paged.runner import BatchRunner

log = logging.getLogger(__name__)


def default_buckets(max_batch: int, max_tokens: int | None = None) -> list[int]:
    """Token counts: 1, 2, 4, 8, 16, then every 16 up to `max_batch` (decode steps); then 2x,
    4x, 6x, ... `max_batch` up to `max_tokens` (steps with prompt chunks; at most 16 of them).
    `max_batch` and `max_tokens` are always buckets."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    top = max_tokens if max_tokens is not None else max_batch
    step = max(max_batch, -(-(top - max_batch) // 16))
    sizes += list(range(2 * max_batch if step == max_batch else max_batch + step, top, step))
    if top > max_batch:
        sizes.append(top)
    return sorted(set(sizes))


def padded_context(
    runner: BatchRunner, size: int, *, capturing: bool = False, decode_only: bool = False
) -> PagedContext:
    """The forward context of a `size`-token bucket over the runner's fixed buffers ("rows"
    attention; `runner.prepare(batch, pad_to=size)` fills them). `decode_only`: every row on
    its own (the one-row kernel), for steps without prompt rows."""
    rows = min(size, runner.max_batch)
    return PagedContext(
        pool=runner.pool,
        cu_seqlens_q=runner.cu_seqlens_q[: rows + 1],
        cu_seqlens_k=runner.cu_seqlens_k[: rows + 1],
        context_lens=runner.context_lens[:rows],
        slot_mapping=runner.slot_mapping[:size],
        block_table=runner.block_table[:rows],
        query_lens=[1] * size,
        seq_lens=[runner.max_seq_len] * size,
        page_counts=[runner.max_pages] * size,
        backend="rows",
        num_splits=runner.graph_splits(size),
        row_seq=runner.row_seq[:size],
        row_lens=runner.row_lens[:size],
        row_table=runner.block_table,
        row_blocks=None if decode_only else (runner.block_first[:size], runner.block_rows[:size]),
        prefill_tiles=0 if decode_only else max_tiles(size, runner.max_batch, runner.tile_tokens),
        tile_count=runner.tile_count,
        capturing=capturing,
    )


class DecodeGraphs:
    """The captured steps of one `BatchRunner` (CUDA only)."""

    def __init__(
        self,
        runner: BatchRunner,
        buckets: Sequence[int] | None = None,
        *,
        decode_graphs: bool = False,
    ) -> None:
        if runner.pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the page pool on a CUDA device")
        sizes = sorted(set(buckets or default_buckets(runner.max_batch, runner.max_tokens)))
        if not sizes or sizes[0] < 1 or sizes[-1] > runner.max_tokens:
            raise ValueError(f"graph buckets {sizes} must lie in 1..max_tokens={runner.max_tokens}")
        self.runner = runner
        self.buckets = sizes
        self.decode_graphs = decode_graphs
        # (bucket, decode only) -> the graph and its logits (a view of `_logits`)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        # Every graph copies its kept rows' logits here as its last kernel. A graph's own
        # output would stay alive in the shared pool, one per graph: 31 graphs of a 7B model at
        # a batch of 64 kept about 0.4 GiB of logits that way, where one buffer is 19 MiB.
        self._logits: torch.Tensor | None = None

    @property
    def captured(self) -> list[int]:
        return sorted({size for size, _ in self._graphs})

    @property
    def captured_decode(self) -> list[int]:
        """The buckets with a decode-only graph (`decode_graphs`)."""
        return sorted(size for size, decode in self._graphs if decode)

    def bucket(self, tokens: int) -> int | None:
        """The captured bucket a step of `tokens` new tokens replays; None: run eager."""
        i = bisect.bisect_left(self.buckets, tokens)
        if i == len(self.buckets):
            return None
        size = self.buckets[i]
        return size if (size, False) in self._graphs else None

    def context(self, size: int, decode_only: bool = False) -> PagedContext:
        return padded_context(self.runner, size, capturing=True, decode_only=decode_only)

    def _kinds(self, size: int) -> list[bool]:
        """The graphs of a bucket: the "rows" one, and a decode-only one where it applies."""
        decode = self.decode_graphs and size <= self.runner.max_batch
        return [False, True] if decode else [False]

    def capture(self) -> list[int]:
        """Capture every bucket, largest first (they share one memory pool); the sizes captured.

        A bucket whose capture fails is left to the eager path, with a warning.
        """
        r = self.runner
        self._pool = torch.cuda.graph_pool_handle()
        for size, decode in [
            (n, d) for n in sorted(self.buckets, reverse=True) for d in self._kinds(n)
        ]:
            r.fill_padding(size)
            ctx = self.context(size, decode)
            keep = r.last_index[: min(size, r.max_batch)]
            try:
                side = torch.cuda.Stream(device=r.pool.device)
                side.wait_stream(torch.cuda.current_stream(r.pool.device))
                with torch.cuda.stream(side), torch.inference_mode(), paged_context(ctx):
                    for _ in range(2):  # first use: kernel selection, allocator warm-up
                        warm = r.forward(size, logits_to_keep=keep)
                torch.cuda.current_stream(r.pool.device).wait_stream(side)
                out = self._output(warm)[: warm.shape[0]]
                del warm
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    paged_context(ctx),
                    torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
                ):
                    out.copy_(r.forward(size, logits_to_keep=keep))
            except Exception as exc:  # a model the capture cannot take runs eager
                kind = "decode-only" if decode else "batched"
                log.warning("CUDA graph of a %d-token %s step not captured: %s", size, kind, exc)
                continue
            # A graph's first launch uploads it to the device (milliseconds for a whole
            # model's step): paid here, not by the first request after a start. The padding
            # rows the capture ran with are still in place, so this writes the padding page.
            graph.replay()
            self._graphs[size, decode] = (graph, out)
        torch.cuda.synchronize(r.pool.device)
        return self.captured

    def _output(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits buffer every graph writes (allocated outside the graphs' pool, once):
        `[max_batch, vocab]` in the logits' dtype."""
        if self._logits is None:
            rows = self.runner.max_batch
            self._logits = logits.new_empty((rows, logits.shape[-1]))
        return self._logits

    def replay(self, size: int, decode_only: bool = False) -> torch.Tensor:
        """Run the captured step of bucket `size` (its decode-only graph, when asked and
        captured); its logits `[min(size, max_batch), vocab]`, one row per sequence row, in the
        buffer every graph shares: valid until the next replay of any bucket, which work
        queued on the same stream before it (sampling, copies to the host) reads safely."""
        graph, logits = self._graphs.get((size, decode_only)) or self._graphs[size, False]
        graph.replay()
        return logits
