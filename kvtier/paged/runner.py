"""`BatchRunner`: one forward for every active sequence, over the paged pool.

Each `step(batch)` takes, for every sequence taking part, the new token ids (one for a decoding
sequence, a chunk of the prompt for a prefilling one), reserves pages for them, flattens them
into one `[1, T]` input, sets the `PagedContext` and runs the model once. It returns the logits
of the last new token of each sequence, in batch order, and advances the lengths. Sequences
join (a fresh `PagedSequence`) and leave (`release`) between steps.

Per-step host data goes through buffers preallocated once (numpy views of pinned CPU tensors,
copied to device tensors of fixed size), so a step allocates no buffer of its own. On CUDA,
`capture_graphs()` records the decode-only step as CUDA graphs over those same buffers
(`kvtier.paged.graphs`); `step` then replays one for a decode-only batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.paged.attention import register
from kvtier.paged.context import PagedContext, paged_context
from kvtier.paged.pool import PagedSequence, PagePool, PoolExhausted
from kvtier.paged.rowblocks import TILE_TOKENS, count_tiles, row_blocks

if TYPE_CHECKING:
    from kvtier.paged.graphs import DecodeGraphs


@dataclass
class SeqInput:
    """One sequence's part of a step: the sequence and its new token ids."""

    seq: PagedSequence
    tokens: Sequence[int]


@dataclass
class Feed:
    """Input tokens that are on the device only: `batch[items[k]]`'s one new token is
    `source[rows[k]]` (its `tokens` hold a placeholder)."""

    items: list[int]
    source: torch.Tensor
    rows: list[int]


class BatchRunner:
    """Runs a transformers causal LM on batches of paged sequences.

    `max_tokens` bounds the new tokens of one step (the token budget), `max_batch` the sequences
    of one step, and `max_seq_len` one sequence's length (the width of the block table).
    Switches `model` to the "kvtier_paged" attention implementation.
    """

    def __init__(
        self,
        model: Any,
        pool: PagePool,
        *,
        max_batch: int = 256,
        max_tokens: int = 8192,
        max_seq_len: int | None = None,
        backend: str = "auto",
    ) -> None:
        if max_seq_len is None:
            max_seq_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
            if max_seq_len <= 0:
                raise ConfigError(
                    "the model config names no max_position_embeddings: pass max_seq_len"
                )
        self.model = model
        self.pool = pool
        self.backend = backend
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_seq_len = max_seq_len
        self.max_pages = pool.pages_for(max_seq_len)
        model.set_attn_implementation(register())

        dev = pool.device
        pin = dev.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        # The step's inputs, as views of three host staging tensors and three device tensors
        # of fixed address (what CUDA graphs replay over): one copy each per step. Numpy views
        # of the host side are written.
        T, B = max_tokens, max_batch
        long_fields = {"ids": T, "pos": T, "slots": T, "last": B, "feed_to": B, "feed_from": B}
        int_fields = {"rowseq": T, "rowlen": T, "blkrow": T, "blkn": T, "cu": B + 1, "cuk": B + 1}
        int_fields["lens"] = B
        int_fields["ntiles"] = 1
        self._h64 = host(sum(long_fields.values()), dtype=torch.long)
        self._h32 = host(sum(int_fields.values()), dtype=torch.int32)
        self._d64 = torch.zeros_like(self._h64, device=dev)
        self._d32 = torch.zeros_like(self._h32, device=dev)
        h64, d64 = _carve(self._h64, long_fields), _carve(self._d64, long_fields)
        h32, d32 = _carve(self._h32, int_fields), _carve(self._d32, int_fields)
        self._h_ids, self._h_pos, self._h_slots = h64["ids"], h64["pos"], h64["slots"]
        self._h_last = h64["last"]
        # tokens fed from the device (see `step`): where each goes, and which source row
        self._h_feed_to, self._h_feed_from = h64["feed_to"], h64["feed_from"]
        self._d_feed_to, self._d_feed_from = d64["feed_to"], d64["feed_from"]
        self._h_cu, self._h_cuk, self._h_lens = h32["cu"], h32["cuk"], h32["lens"]
        self._h_rowseq, self._h_rowlen = h32["rowseq"], h32["rowlen"]
        self._h_blkrow, self._h_blkn = h32["blkrow"], h32["blkn"]
        self._h_ntiles = h32["ntiles"]
        # one table row per sequence, plus the padding row (index max_batch) of graph steps
        self._h_table = host(max_batch + 1, self.max_pages, dtype=torch.int32)
        self.input_ids = d64["ids"].view(1, T)
        self.position_ids = d64["pos"].view(1, T)
        self.slot_mapping = d64["slots"]
        self.last_index = d64["last"]
        self.cu_seqlens_q, self.cu_seqlens_k = d32["cu"], d32["cuk"]
        self.context_lens = d32["lens"]
        self.block_table = torch.zeros(max_batch + 1, self.max_pages, dtype=torch.int32, device=dev)
        # per token: its sequence's block-table row, and its context (position + 1), for the
        # "rows" attention backend (every token one row of the decode kernel)
        self.row_seq, self.row_lens = d32["rowseq"], d32["rowlen"]
        # the step's row blocks (kvtier.paged.rowblocks): first row and rows of each; a
        # prompt chunk's rows in tiles of `tile_tokens` (the prefill kernel's), first, then
        # every decode token a block of its own (the decode kernel's)
        self.block_first, self.block_rows = d32["blkrow"], d32["blkn"]
        self.tile_count = d32["ntiles"]  # the step's prompt tiles (first in the block list)
        self.tile_tokens = TILE_TOKENS
        # The host buffers are rewritten each step: wait until the last step's copies are done.
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: DecodeGraphs | None = None
        self._trash: int | None = None  # the page padding rows of a graph step write to
        # a step replays its graph only when its attention work, the sum over its new tokens of
        # their context lengths, is at most this: the "rows" kernel re-reads a sequence's K/V for
        # every prompt token, where the eager path's flash kernel for prompt chunks shares it.
        # Measured on an H200 (bench/paged_step.py, Qwen2-7B shape): 64 decode tokens plus two
        # 512-token chunks over 3,000-token contexts (3.3 M pairs) took 60 ms replayed and 45 ms
        # eager on an idle host; but inside the serving process (bench/agent_fleet.py
        # --concurrent) such eager steps took 108 ms at the median, their ~2,300 kernel launches
        # sharing the interpreter with the HTTP, restore and commit threads, where a replay
        # launches one graph.
        self.graph_max_pairs = 4_000_000
        self.graph_steps = 0  # forwards replayed from a CUDA graph
        self.eager_steps = 0

    def capture_graphs(
        self, buckets: Sequence[int] | None = None, *, decode_graphs: bool = False
    ) -> list[int]:
        """Record the step as CUDA graphs, one per bucket of new tokens (default: 1, 2, 4, 8,
        16, then every 16 up to max_batch, then coarser up to max_tokens); the sizes captured.
        `decode_graphs`: a second graph per bucket up to max_batch for steps without prompt
        rows, on the one-row kernel (kvtier.paged.graphs). CUDA only. Takes one page of the
        pool for the padding rows."""
        from kvtier.paged.graphs import DecodeGraphs

        if self.pool.quantized:
            raise ConfigError(
                "an int8 page pool (degraded_kv = int8) runs its steps eager: CUDA graphs record "
                "the Triton 'rows' kernel, which reads native K/V"
            )
        graphs = DecodeGraphs(self, buckets, decode_graphs=decode_graphs)
        self.reserve_padding_page()
        graphs.capture()
        self.graphs = graphs
        return graphs.captured

    def reserve_padding_page(self) -> int:
        """Take the page padding tokens write their K/V to (once), and point the padding row of
        the block table at it; the page."""
        if self._trash is None:
            pages = self.pool.alloc(1)
            if pages is None:
                raise PoolExhausted(1, 0)
            self._trash = pages[0]
            self._h_table[self.max_batch, 0] = self._trash
            self.block_table[self.max_batch, 0] = self._trash
        return self._trash

    def graph_splits(self, size: int) -> int:
        """The decode kernel's splits per row for a captured step of `size` rows (tokens): at
        most `max_batch` of them are decode rows (the prompt rows are the prefill kernel's)."""
        if self.pool.device.type != "cuda":
            return 1  # the CPU's per-row reference has no splits
        from kvtier.paged.triton_decode import choose_splits, default_block_n

        geometry = self.pool.geometry
        sms = torch.cuda.get_device_properties(self.pool.device).multi_processor_count
        block_n = default_block_n(geometry.head_dim)
        rows = min(size, self.max_batch)
        return choose_splits(rows, geometry.num_kv_heads, self.max_seq_len, block_n, sms)

    def fill_padding(self, size: int) -> None:
        """Make every row of a `size`-token step padding (host and device): one token at
        position 0, its K/V written to the padding page, a one-token context on that page."""
        assert self._trash is not None, "capture_graphs() takes the padding page"
        if self._copied is not None:
            self._copied.synchronize()
        rows = min(size, self.max_batch)
        self._h_cu.numpy()[0] = self._h_cuk.numpy()[0] = 0
        self._pad_host(0, size, 0, rows)
        self._write_blocks([], size)
        self._to_device(size, 1, rows)

    def _pad_host(self, t0: int, t1: int, r0: int, r1: int) -> None:
        """Host buffers: tokens `t0..t1-1` and sequence rows `r0..r1-1` become padding."""
        assert self._trash is not None
        page = self.pool.page_size
        self._h_ids.numpy()[t0:t1] = 0
        self._h_pos.numpy()[t0:t1] = 0
        self._h_slots.numpy()[t0:t1] = self._trash * page + np.arange(t0, t1) % page
        self._h_rowseq.numpy()[t0:t1] = self.max_batch
        self._h_rowlen.numpy()[t0:t1] = 1
        self._h_lens.numpy()[r0:r1] = 1
        self._h_last.numpy()[r0:r1] = 0
        self._h_table.numpy()[r0:r1, 0] = self._trash
        cu, cuk = self._h_cu.numpy(), self._h_cuk.numpy()
        for i in range(r0, r1):
            cu[i + 1] = cu[i] + 1
            cuk[i + 1] = cuk[i] + 1

    def forward(self, size: int, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The model over the first `size` tokens of the step buffers (a `PagedContext` must be
        set); the logits `[kept, vocab]`."""
        out = self.model(
            input_ids=self.input_ids[:, :size],
            position_ids=self.position_ids[:, :size],
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def release(self, seq: PagedSequence) -> None:
        """The sequence leaves: its pages go back to the pool (shared pages lose a reference)."""
        self.pool.release(seq)

    def _check(self, batch: Sequence[SeqInput]) -> int:
        if not batch:
            raise ValueError("a step needs at least one sequence")
        if len(batch) > self.max_batch:
            raise ConfigError(f"{len(batch)} sequences exceed max_batch={self.max_batch}")
        if len({id(item.seq) for item in batch}) != len(batch):
            raise ValueError("a sequence appears twice in one step")
        total = 0
        for item in batch:
            n = len(item.tokens)
            if n == 0:
                raise ValueError("every sequence of a step needs at least one new token")
            if item.seq.length + n > self.max_seq_len:
                raise ConfigError(
                    f"a sequence would grow to {item.seq.length + n} tokens, over max_seq_len="
                    f"{self.max_seq_len}"
                )
            total += n
        if total > self.max_tokens:
            raise ConfigError(
                f"{total} new tokens exceed the step budget max_tokens={self.max_tokens}; "
                "prefill long prompts in chunks"
            )
        return total

    def reserve(self, batch: Sequence[SeqInput]) -> None:
        """Reserve pages for every sequence of the step, all or nothing (`PoolExhausted`)."""
        needed = sum(self.pool.pages_needed(item.seq, len(item.tokens)) for item in batch)
        if needed > self.pool.num_free:
            raise PoolExhausted(needed, self.pool.num_free)
        for item in batch:
            ok = self.pool.reserve(item.seq, len(item.tokens))
            assert ok, "pages were counted free just above"

    def step(self, batch: Sequence[SeqInput], feed: Feed | None = None) -> torch.Tensor:
        """Run one forward; logits `[len(batch), vocab]` of each sequence's last new token.

        `feed` takes the one token of some sequences from a device tensor instead of their
        `tokens` (a token sampled by the step before, not yet read back to the host).
        Raises `PoolExhausted` (nothing changed) when the pool cannot hold the new tokens.
        """
        size = self._graph_size(batch)
        if size is not None:
            return self._replay(batch, size, feed)
        return self._eager(batch, feed)

    def _eager(self, batch: Sequence[SeqInput], feed: Feed | None = None) -> torch.Tensor:
        ctx = self.prepare(batch, feed=feed)
        b, total = ctx.num_seqs, int(ctx.slot_mapping.shape[0])
        with torch.inference_mode(), paged_context(ctx):
            logits = self.forward(total, logits_to_keep=self.last_index[:b])
        self.eager_steps += 1
        self.advance(batch)
        return logits

    def _replay(
        self, batch: Sequence[SeqInput], size: int, feed: Feed | None = None
    ) -> torch.Tensor:
        assert self.graphs is not None
        self.prepare(batch, pad_to=size, feed=feed)
        decode_only = all(len(item.tokens) == 1 for item in batch)
        logits = self.graphs.replay(size, decode_only)[: len(batch)]
        self.graph_steps += 1
        self.advance(batch)
        return logits

    def _graph_size(self, batch: Sequence[SeqInput]) -> int | None:
        """The CUDA graph bucket of a step (by its new tokens); None: the step runs eager."""
        if self.graphs is None or self.backend not in ("auto", "rows"):
            return None
        pairs = 0
        for item in batch:
            n, old = len(item.tokens), item.seq.length
            pairs += n * old + n * (n + 1) // 2
        if pairs > self.graph_max_pairs:
            return None
        return self.graphs.bucket(sum(len(item.tokens) for item in batch))

    @staticmethod
    def advance(batch: Sequence[SeqInput]) -> None:
        """Count the step's tokens as written (after the forward stored their K/V)."""
        for item in batch:
            item.seq.length += len(item.tokens)

    def prepare(
        self, batch: Sequence[SeqInput], pad_to: int | None = None, feed: Feed | None = None
    ) -> PagedContext:
        """Reserve pages, fill the step's input buffers and return the forward context.

        `self.input_ids[:, :T]` and `self.position_ids[:, :T]` hold the flattened input after it.
        `pad_to` (a CUDA graph's bucket of tokens) adds padding tokens up to that many, and
        padding sequence rows up to `min(pad_to, max_batch)`; the context is then the padded
        step's ("rows" attention, as the graph of that bucket runs it). `feed` (see `step`)
        then overwrites some input ids on the device.
        """
        total = self._check(batch)
        self.reserve(batch)
        if self._copied is not None:
            self._copied.synchronize()
        ids, pos, slots = self._h_ids.numpy(), self._h_pos.numpy(), self._h_slots.numpy()
        cu, lens, last = self._h_cu.numpy(), self._h_lens.numpy(), self._h_last.numpy()
        table = self._h_table.numpy()
        rowseq, rowlen = self._h_rowseq.numpy(), self._h_rowlen.numpy()
        page = self.pool.page_size
        query_lens, seq_lens, page_counts = [], [], []
        t = 0
        cuk = self._h_cuk.numpy()
        cu[0] = cuk[0] = 0
        for i, item in enumerate(batch):
            seq, n = item.seq, len(item.tokens)
            old = seq.length
            ids[t : t + n] = item.tokens
            pos[t : t + n] = range(old, old + n)
            slots[t : t + n] = [seq.pages[p // page] * page + p % page for p in range(old, old + n)]
            rowseq[t : t + n] = i
            rowlen[t : t + n] = range(old + 1, old + n + 1)
            t += n
            cu[i + 1] = t
            cuk[i + 1] = cuk[i] + old + n
            lens[i] = old + n
            last[i] = t - 1
            count = self.pool.pages_for(old + n)
            table[i, :count] = seq.pages[:count]
            query_lens.append(n)
            seq_lens.append(old + n)
            page_counts.append(count)
        b = len(batch)
        self._write_blocks(query_lens, pad_to or total)
        if feed is not None:  # into the staging tensor, so the one copy below takes it along
            for i in feed.items:
                if query_lens[i] != 1:
                    raise ValueError("a token fed from the device replaces a one-token input")
            self._h_feed_to.numpy()[: len(feed.items)] = [int(cu[i]) for i in feed.items]
            self._h_feed_from.numpy()[: len(feed.items)] = feed.rows
        if pad_to is not None:
            from kvtier.paged.graphs import padded_context

            rows = min(pad_to, self.max_batch)
            self._pad_host(total, pad_to, b, rows)
            self._to_device(pad_to, max(page_counts), rows)
            self._apply_feed(feed)
            return padded_context(self, pad_to)  # what the buffers now hold: the padded step
        self._to_device(total, max(page_counts), b)
        self._apply_feed(feed)
        ctx = PagedContext(
            pool=self.pool,
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            cu_seqlens_k=self.cu_seqlens_k[: b + 1],
            context_lens=self.context_lens[:b],
            slot_mapping=self.slot_mapping[:total],
            block_table=self.block_table[:b],
            query_lens=query_lens,
            seq_lens=seq_lens,
            page_counts=page_counts,
            backend=self.backend,
            row_seq=self.row_seq[:total],
            row_lens=self.row_lens[:total],
            row_table=self.block_table,
            row_blocks=(self.block_first[:total], self.block_rows[:total]),
            prefill_tiles=int(self._h_ntiles.numpy()[0]),  # _write_blocks counted them
            tile_count=self.tile_count,
        )
        return ctx

    def _apply_feed(self, feed: Feed | None) -> None:
        """On the device, after the staging copy: the fed sequences' input ids from the source
        tensor (no host round trip, so this step can start before the last one's tokens are
        read back)."""
        if feed is None or not feed.items:
            return
        n = len(feed.items)
        tokens = feed.source.index_select(0, self._d_feed_from[:n])
        self.input_ids[0].index_copy_(0, self._d_feed_to[:n], tokens)

    def _write_blocks(self, query_lens: Sequence[int], size: int) -> None:
        """Host row blocks of a `size`-token step: the sequences' (`query_lens`; their prompt
        tiles first), then every token after them (padding) a block of its own, then empty
        entries up to `size`."""
        first, rows = row_blocks(query_lens, self.tile_tokens)
        total = sum(query_lens)
        n = len(first)
        blk_first, blk_rows = self._h_blkrow.numpy(), self._h_blkn.numpy()
        blk_first[:n], blk_rows[:n] = first, rows
        self._h_ntiles.numpy()[0] = count_tiles(query_lens, self.tile_tokens)
        pad = size - total
        blk_first[n : n + pad] = range(total, size)
        blk_rows[n : n + pad] = 1
        blk_first[n + pad : size] = 0
        blk_rows[n + pad : size] = 0

    def _to_device(self, tokens: int, width: int, rows: int) -> None:
        """Copy the host buffers to the device buffers: the token and sequence inputs whole
        (`tokens` of them are this step's), and `rows` x `width` of the block table."""
        b = rows
        nb = self.pool.device.type == "cuda"
        # whole staging tensors (tens of KB): three copies instead of one per input
        self._d64.copy_(self._h64, non_blocking=nb)
        self._d32.copy_(self._h32, non_blocking=nb)
        self.block_table[:b, :width].copy_(self._h_table[:b, :width], non_blocking=nb)
        if self._copied is not None:
            # on the pool device's stream, which the copies above ran on (a model placed
            # across devices leaves another device current after its forward)
            self._copied.record(torch.cuda.current_stream(self.pool.device))


def _carve(flat: torch.Tensor, fields: dict[str, int]) -> dict[str, torch.Tensor]:
    """Consecutive views of `flat`, one per field, of the given lengths."""
    out, at = {}, 0
    for name, n in fields.items():
        out[name] = flat[at : at + n]
        at += n
    return out
