"""`PagePool`: one preallocated KV tensor per device, cut into fixed-size pages.

Every layer's K and V for every sequence live in ONE tensor,

    kv[layer, k|v, page, offset, kv_head, head_dim]     (the model's dtype)

allocated once from a byte budget. A sequence owns a *page table*: a plain Python list of page
ids, token `t` of the sequence lives at `(table[t // page_size], t % page_size)`. Pages are
handed out from a free list and carry a reference count, so sequences with a common prefix can
share full pages; a shared page is never written (copy-on-write at the tail: appending into a
shared, partially filled last page first copies it to a private page).

`alloc`, `free`, `share` and `reserve` touch only Python lists: no tensor is made per sequence or
per step. Only a copy-on-write copies page contents (one page, all layers, inside the pool).

The chunk helpers (`chunk_pages`, `gather`, `scatter`) map a run of tokens of a sequence to and
from the L2 chunk layout `[layer, k|v, token, kv_head, head_dim]`, so a transfer engine can move a
256-token chunk between pages and an L2 slot.

With `kv_dtype="int8"` (degraded mode, kvtier.server.devices.streaming) the pool stores K/V as int8
with a float32 scale per (token, kv head) (`kvtier.paged.quant`): `kv` is int8 and `scales`
`[layer, k|v, page, offset, kv_head]` holds the scales, so the same bytes hold about twice the
tokens of fp16/bf16. Writers (`write_layer`, `scatter`) quantize; readers (`gather_layer`,
`gather`) hand back the model's dtype; `layer_cache` refuses such a pool, as a kernel reading it
would take int8 for values (paged attention reads it through `kvtier.paged.int8`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import ConfigError, KvtierError
from kvtier.geometry import KVGeometry
from kvtier.paged.quant import KV_DTYPES, SCALE_DTYPE, bytes_per_value, dequantize_kv, quantize_kv

CHUNK_TOKENS = 256  # tokens in one L2/L3 chunk; a page size must divide it


class PoolExhausted(KvtierError):
    """The page pool has too few free pages for a step; free or preempt a sequence and retry."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(
            f"the KV page pool needs {needed} free pages for this step but has {free}: finish, "
            "offload or preempt a sequence (BatchRunner.release) and retry, or give the pool a "
            "larger byte budget"
        )
        self.needed = needed
        self.free = free


@dataclass
class PagedSequence:
    """A sequence's place in the pool: its page table and how many tokens it holds.

    `pages` is the page table (page ids in token order); `length` counts the tokens whose K/V
    are written. The pool may hold pages beyond `length` (room reserved for the next tokens).
    """

    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagePool:
    """Preallocated paged KV storage for every layer of one model on one device.

    `budget_bytes` sizes the pool: `num_pages = budget_bytes // page_bytes`, where a page holds
    `page_size` tokens of K and V of every layer (`KVGeometry.bytes_per_token * page_size`, or
    less with `kv_dtype="int8"`). `dtype` is the model's: what readers hand back.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        budget_bytes: int,
        *,
        page_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        kv_dtype: str = "native",
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype {kv_dtype!r} is unknown; use one of {KV_DTYPES}")
        if geometry.attention == "mla":
            raise ConfigError("the page pool holds separate K and V; MLA latents are not supported")
        if geometry.v_head_dim != geometry.head_dim:
            raise ConfigError(
                f"K head dim {geometry.head_dim} != V head dim {geometry.v_head_dim}: the page "
                "pool needs equal dims"
            )
        if not isinstance(page_size, int) or page_size <= 0 or CHUNK_TOKENS % page_size:
            raise ConfigError(
                f"page_size {page_size!r} must be a positive divisor of the {CHUNK_TOKENS}-token "
                "chunk (1, 2, 4, ..., 256)"
            )
        self.geometry = geometry
        self.page_size = page_size
        self.dtype = dtype if dtype is not None else geometry.torch_dtype()
        self.kv_dtype = kv_dtype
        rows = geometry.num_layers * 2 * geometry.num_kv_heads * page_size
        self.page_bytes = rows * bytes_per_value(kv_dtype, self.dtype, geometry.head_dim)
        # what a page takes in the model's dtype (a pool rebuilt native is sized by it)
        self.native_page_bytes = rows * bytes_per_value("native", self.dtype, geometry.head_dim)
        self.num_pages = int(budget_bytes) // self.page_bytes
        if self.num_pages <= 0:
            raise ConfigError(
                f"a KV budget of {budget_bytes} bytes holds no page of {self.page_bytes} bytes "
                f"({page_size} tokens); raise the budget or lower page_size"
            )
        self.kv = torch.zeros(
            (
                geometry.num_layers,
                2,
                self.num_pages,
                page_size,
                geometry.num_kv_heads,
                geometry.head_dim,
            ),
            dtype=torch.int8 if self.quantized else self.dtype,
            device=device,
        )
        self.scales: torch.Tensor | None = None
        if self.quantized:
            self.scales = torch.zeros(self.kv.shape[:5], dtype=SCALE_DTYPE, device=device)
        self.device = self.kv.device
        # Highest id last, so pop() hands out pages in ascending order (easier to read in tests).
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * self.num_pages

    @property
    def quantized(self) -> bool:
        """K/V stored as int8 plus scales (`kv_dtype="int8"`)."""
        return self.kv_dtype == "int8"

    # ---- page accounting (Python lists only) -------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        """How many page tables hold `page` (0: free)."""
        return self._refs[page]

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages (refcount 1 each); None, taking nothing, when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        return [self._take() for _ in range(n)]

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def share(self, pages: Sequence[int]) -> list[int]:
        """Add a reference to each page (a second sequence now holds them); returns a new table."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is free; only allocated pages can be shared")
        for p in pages:
            self._refs[p] += 1
        return list(pages)

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page whose count reaches 0 goes back to the list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is already free (double free)")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def fork(self, seq: PagedSequence, tokens: int | None = None) -> PagedSequence:
        """A new sequence sharing the first `tokens` (default: all) of `seq`'s tokens.

        The pages that hold those tokens are shared, not copied; a partially filled last page is
        copied only when one of the two sequences appends to it (see `reserve`).
        """
        n = seq.length if tokens is None else tokens
        if not 0 <= n <= seq.length:
            raise ValueError(f"cannot fork {n} tokens of a sequence of {seq.length}")
        return PagedSequence(self.share(seq.pages[: self.pages_for(n)]), n)

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def pages_needed(self, seq: PagedSequence, new_tokens: int) -> int:
        """Free pages `reserve(seq, new_tokens)` would take (growth plus a copy-on-write)."""
        grow = max(0, self.pages_for(seq.length + new_tokens) - len(seq.pages))
        return grow + int(new_tokens > 0 and self._tail_is_shared(seq))

    def _tail_is_shared(self, seq: PagedSequence) -> bool:
        offset = seq.length % self.page_size
        if offset == 0:
            return False  # the next token starts a new page; shared full pages stay untouched
        return self._refs[seq.pages[seq.length // self.page_size]] > 1

    def reserve(self, seq: PagedSequence, new_tokens: int) -> bool:
        """Make room in `seq` for `new_tokens` more tokens; False, changing nothing, if full.

        Appends pages to the table as needed, and first replaces a shared, partially filled last
        page by a private copy (copy-on-write), so that writing the new tokens never changes
        another sequence's KV.
        """
        if self.pages_needed(seq, new_tokens) > len(self._free):
            return False
        if new_tokens > 0 and self._tail_is_shared(seq):
            index = seq.length // self.page_size
            old = seq.pages[index]
            new = self._take()
            self._copy_page(new, old)
            self.free([old])
            seq.pages[index] = new
        grow = self.pages_for(seq.length + new_tokens) - len(seq.pages)
        if grow > 0:
            seq.pages.extend(self._take() for _ in range(grow))
        return True

    def _copy_page(self, new: int, old: int) -> None:
        """Copy one page's contents, every layer (a copy-on-write)."""
        self.kv[:, :, new].copy_(self.kv[:, :, old])
        if self.scales is not None:
            self.scales[:, :, new].copy_(self.scales[:, :, old])

    def release(self, seq: PagedSequence) -> None:
        """Give back every page of `seq` and empty it."""
        self.free(seq.pages)
        seq.pages.clear()
        seq.length = 0

    # ---- views for attention ------------------------------------------------------------------

    def storage(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One layer's stored K and V pages (`[num_pages, page_size, kv_heads, head_dim]`, int8
        in an int8 pool) and their scales (`[num_pages, page_size, kv_heads]`; None: native)."""
        ks = vs = None
        if self.scales is not None:
            ks, vs = self.scales[layer, 0], self.scales[layer, 1]
        return self.kv[layer, 0], self.kv[layer, 1], ks, vs

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of one layer, each `[num_pages, page_size, kv_heads, head_dim]` (views)."""
        if self.quantized:
            raise KvtierError(
                "this page pool stores int8 K/V (degraded_kv = int8): read it with gather_layer "
                "or gather and write it with write_layer or scatter, not through layer_cache"
            )
        k, v, _, _ = self.storage(layer)
        return k, v

    def write_layer(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store `[T, kv_heads, dim]` K/V of one layer at flat `slots` (on the layer's device),
        quantized in an int8 pool."""
        k_cache, v_cache, ks, vs = self.storage(layer)
        n = k_cache.shape[0] * k_cache.shape[1]
        if ks is None or vs is None:
            k_cache.view(n, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
            v_cache.view(n, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
            return
        for cache, scales, x in ((k_cache, ks, key), (v_cache, vs, value)):
            q, s = quantize_kv(x)
            cache.view(n, *cache.shape[2:]).index_copy_(0, slots, q)
            scales.view(n, scales.shape[2]).index_copy_(0, slots, s)

    def slot(self, table: Sequence[int], token: int) -> int:
        """Flat slot (`page * page_size + offset`) of token `token` of a sequence."""
        return table[token // self.page_size] * self.page_size + token % self.page_size

    # ---- chunk <-> pages (the L2 restore / offload path) ---------------------------------------

    def chunk_pages(self, table: Sequence[int], chunk: int) -> list[int]:
        """Page ids holding tokens `[chunk * 256, (chunk + 1) * 256)` of a sequence.

        Whole pages only, since the page size divides the chunk; a sequence's last chunk may be
        partial and then has fewer pages.
        """
        per_chunk = CHUNK_TOKENS // self.page_size
        return list(table[chunk * per_chunk : (chunk + 1) * per_chunk])

    def slots(
        self,
        table: Sequence[int],
        start: int,
        end: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Flat slots (page * page_size + offset) of tokens `[start, end)`, on `device`
        (default: the pool's)."""
        if not 0 <= start <= end <= len(table) * self.page_size:
            raise ValueError(
                f"token range [{start}, {end}) is outside the {len(table)} pages of the table"
            )
        s = self.page_size
        first = start // s
        pages = np.asarray(table[first : (end - 1) // s + 1 if end > start else first], np.int64)
        offsets = np.arange(s, dtype=np.int64)
        slots = (pages[:, None] * s + offsets).reshape(-1)[start - first * s : end - first * s]
        return to_device(torch.from_numpy(slots), self.device if device is None else device)

    def _span(self, tokens: int) -> tuple[int, ...]:
        """The shape `gather` gives `tokens` tokens in: `[layer, k|v, token, head, dim]`."""
        return (*self.kv.shape[:2], tokens, *self.kv.shape[4:])

    def _flat(self) -> torch.Tensor:
        g = self.geometry
        return self.kv.view(g.num_layers, 2, self.num_pages * self.page_size, *self.kv.shape[4:])

    def _flat_scales(self) -> torch.Tensor:
        assert self.scales is not None
        g = self.geometry
        return self.scales.view(g.num_layers, 2, self.num_pages * self.page_size, -1)

    def gather_chunks(
        self, table: Sequence[int], start: int, end: int, chunk_tokens: int
    ) -> list[torch.Tensor]:
        """Tokens `[start, end)` of a sequence gathered by chunk of `chunk_tokens` (the last one
        may be shorter), each one contiguous `[layer, k|v, token, head, dim]`."""
        return [
            self.gather(table, a, min(a + chunk_tokens, end))
            for a in range(start, end, chunk_tokens)
        ]

    def gather(
        self,
        table: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor | None = None,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        """Tokens `[start, end)` of a sequence as one contiguous `[layer, k|v, token, head, dim]`.

        `out` (any device, e.g. a pinned L2 slot) receives the copy when given; with
        `non_blocking` a device-to-pinned-host copy is queued on the current stream and the
        caller synchronizes before reading `out`. Bit-exact: `scatter` restores the same bytes
        (in an int8 pool: the dequantized values, in the model's dtype).
        """
        if out is not None and end - start > CHUNK_TOKENS:
            # by chunk: the device holds one chunk's gathered copy at a time, not the whole
            # sequence's (a 3,000-token 7B context is 172 MB), whatever `out` is
            need = self._span(end - start)
            if tuple(out.shape) != need or out.dtype != self.dtype:
                raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, need {need}")
            for a in range(start, end, CHUNK_TOKENS):
                b = min(a + CHUNK_TOKENS, end)
                self.gather(
                    table, a, b, out[:, :, a - start : b - start], non_blocking=non_blocking
                )
            return out
        slots = self.slots(table, start, end)
        if out is not None and not self.quantized and out.device == self.device:
            # straight into `out` (a commit's gather buffer): no tensor of its size is made
            if tuple(out.shape) != self._span(end - start) or out.dtype != self.dtype:
                raise ValueError(
                    f"out is {tuple(out.shape)} {out.dtype}, need {self._span(end - start)}"
                )
            with torch.no_grad():  # a copy for storage: never part of a graph
                return torch.index_select(self._flat(), 2, slots, out=out)
        data = self._flat().index_select(2, slots)
        if self.quantized:
            data = dequantize_kv(data, self._flat_scales().index_select(2, slots), self.dtype)
        if out is None:
            return data
        if out.shape != data.shape or out.dtype != data.dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, need {tuple(data.shape)}")
        out.copy_(data, non_blocking=non_blocking)
        return out

    def to_host(self, table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Tokens `[start, end)` copied to host memory (what `gather` gives, on the CPU), one
        chunk at a time: where a turn's K/V waits beside the pool (preempted, or its parked table
        given up), outside the GPU memory budget. `scatter` writes it back."""
        out = torch.empty(self._span(end - start), dtype=self.dtype, device="cpu")
        return self.gather(table, start, end, out)

    def gather_layer(
        self, table: Sequence[int], start: int, end: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of tokens `[start, end)`, each contiguous `[tokens, head, dim]`
        in the model's dtype (dequantized from an int8 pool)."""
        k, v, ks, vs = self.storage(layer)
        slots = self.slots(table, start, end, k.device)  # a sharded pool: the layer's device
        s = self.num_pages * self.page_size
        out = []
        for cache, scales in ((k, ks), (v, vs)):
            x = cache.reshape(s, *cache.shape[2:]).index_select(0, slots)
            if scales is not None:
                x = dequantize_kv(x, scales.reshape(s, -1).index_select(0, slots), self.dtype)
            out.append(x)
        return out[0], out[1]

    def _check_unshared(self, table: Sequence[int], start: int, end: int) -> None:
        """Tokens `[start, end)` of a sequence may be written: none of their pages is shared."""
        if end <= start:
            return
        s = self.page_size
        pages = table[start // s : (end - 1) // s + 1]
        shared = sorted({p for p in pages if self._refs[p] > 1})
        if shared:
            raise ValueError(f"pages {shared} are shared; a shared page is never written")

    def scatter(
        self, table: Sequence[int], start: int, src: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """Write `src` (`[layer, k|v, token, head, dim]`, any device) at tokens `start...`.

        The reverse of `gather`; the pages must be allocated (see `reserve`) and not shared.
        """
        end = start + src.shape[2]
        expected = self._span(end - start)
        if tuple(src.shape) != expected:
            raise ValueError(f"src is {tuple(src.shape)}, need {expected}")
        if end - start > CHUNK_TOKENS:
            # by chunk: one chunk's copy on the pool's device at a time (see `gather`)
            for a in range(0, end - start, CHUNK_TOKENS):
                part = src[:, :, a : a + CHUNK_TOKENS]
                self.scatter(table, start + a, part, non_blocking=non_blocking)
            return
        slots = self.slots(table, start, end)
        self._check_unshared(table, start, end)
        data = src.to(device=self.device, dtype=self.dtype, non_blocking=non_blocking)
        if self.quantized:
            q, scale = quantize_kv(data)
            self._flat().index_copy_(2, slots, q)
            self._flat_scales().index_copy_(2, slots, scale)
            return
        self._flat().index_copy_(2, slots, data)

    def write_chunks(
        self, table: Sequence[int], first: int, chunks: torch.Tensor, start: int = 0
    ) -> None:
        """Write `chunks` (`[count, layer, k|v, token, head, dim]`, consecutive, the first at
        token `first`) into a sequence's pages, from token `start` on (the tokens before it
        are left as they are: full pages the table shares). What a restore from L2 lands in
        pages with (`TieredCache.load_staged`)."""
        per = chunks.shape[3]
        size = self.page_size
        for c in range(chunks.shape[0]):
            a = first + c * per
            if a + per <= start:
                continue
            if per == size and a >= start and not self.quantized and a % size == 0:
                # a chunk is one page (256-token pages): one copy, no slot index to upload
                page = table[a // size]
                self._check_unshared(table, a, a + per)
                self.kv[:, :, page].copy_(chunks[c])
                continue
            skip = max(0, start - a)
            self.scatter(table, a + skip, chunks[c, :, :, skip:])


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (indices) on `device`, without waiting for the device's work.

    To CUDA it goes through pinned memory (the caching host allocator's, which keeps a block
    until its copy is done): from pageable memory the driver may synchronize with the stream
    first, so the scheduler thread would wait there for the steps in flight."""
    target = torch.device(device)
    if target.type == "cuda":
        host = host.pin_memory()
    return host.to(target, non_blocking=True)
