"""`ShardedPagePool`: the page pool split by layer across the devices of a placement.

A page id names the same tokens on every device; each device holds the K/V of *its* layers
for every page (`kv_d[local_layer, k|v, page, offset, kv_head, head_dim]`), so no attention
reads another device's memory. Page accounting (free list, refcounts, copy-on-write) is the
`PagePool`'s, shared by all devices; only the storage is split. The paged attention function
finds a layer's pages with `layer_cache(layer)` as on one device, and the step's index tensors
on the layer's device with `context_on` (copied once per step and device).

`gather` / `scatter` move a run of tokens between the pages and the chunk layout
`[layer, k|v, token, kv_head, head_dim]` with one stream per device: each device's layers
travel over its own link at the same time (non_blocking: `synchronize()` before reading).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.paged.context import PagedContext
from kvtier.paged.pool import PagePool
from kvtier.paged.quant import SCALE_DTYPE, dequantize_kv, quantize_kv
from kvtier.placement import Placement


def _runs(layers: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive global layer ids: (local start, global start, length)."""
    out: list[tuple[int, int, int]] = []
    for local, g in enumerate(layers):
        if out and out[-1][1] + out[-1][2] == g:
            a, b, n = out[-1]
            out[-1] = (a, b, n + 1)
        else:
            out.append((local, g, 1))
    return out


@dataclasses.dataclass
class Shard:
    device: torch.device
    layers: list[int]  # global layer ids, ascending
    kv: torch.Tensor  # [len(layers), 2, num_pages, page_size, kv_heads, head_dim]
    stream: Any = None  # a torch.cuda.Stream on CUDA
    scales: torch.Tensor | None = None  # an int8 pool's: [len(layers), 2, pages, size, heads]

    def flat(self) -> torch.Tensor:
        n, _, pages, size = self.kv.shape[:4]
        return self.kv.view(n, 2, pages * size, *self.kv.shape[4:])

    def flat_scales(self) -> torch.Tensor:
        assert self.scales is not None
        n, _, pages, size = self.kv.shape[:4]
        return self.scales.view(n, 2, pages * size, -1)


class ShardedPagePool(PagePool):
    """Pages of every layer of a model, each layer's storage on its device of `placement`.

    `budget_bytes` sizes the pool as for `PagePool` (all layers of a page); device `d` then
    holds `page_bytes * len(its layers) / num_layers` per page. `device` (where the batch's
    index tensors live) is the placement's primary device.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        budget_bytes: int,
        placement: Placement,
        *,
        page_size: int = 16,
        dtype: torch.dtype | None = None,
        kv_dtype: str = "native",
    ) -> None:
        if len(placement.layers) != geometry.num_layers:
            raise ConfigError(
                f"the placement covers {len(placement.layers)} layers, the model's KV has "
                f"{geometry.num_layers}"
            )
        # validation and page accounting from PagePool, with no storage (meta tensor)
        super().__init__(
            geometry,
            budget_bytes,
            page_size=page_size,
            device="meta",
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        self.placement = placement
        self.device = placement.devices[placement.primary]
        self.shards: list[Shard] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * geometry.num_layers
        for d in placement.used():
            layers = placement.layers_on(d)
            dev = placement.devices[d]
            kv = torch.zeros((len(layers), *self.kv.shape[1:]), dtype=self.kv.dtype, device=dev)
            scales = None
            if self.quantized:
                scales = torch.zeros(kv.shape[:5], dtype=SCALE_DTYPE, device=dev)
            stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            for local, g in enumerate(layers):
                self._where[g] = (len(self.shards), local)
            self.shards.append(Shard(dev, layers, kv, stream, scales))

    def bytes_on(self, device: int) -> int:
        """Bytes of pool storage on logical device `device`."""
        for shard, d in zip(self.shards, self.placement.used(), strict=True):
            if d == device:
                scales = 0 if shard.scales is None else shard.scales.numel() * 4
                return shard.kv.numel() * shard.kv.element_size() + scales
        return 0

    def storage(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        s, local = self._where[layer]
        shard = self.shards[s]
        ks = vs = None
        if shard.scales is not None:
            ks, vs = shard.scales[local, 0], shard.scales[local, 1]
        return shard.kv[local, 0], shard.kv[local, 1], ks, vs

    def _copy_page(self, new: int, old: int) -> None:
        for shard in self.shards:
            shard.kv[:, :, new].copy_(shard.kv[:, :, old])
            if shard.scales is not None:
                shard.scales[:, :, new].copy_(shard.scales[:, :, old])

    def gather(
        self,
        table: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor | None = None,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        """As `PagePool.gather`; each device copies its layers on its own stream."""
        shape = (*self.kv.shape[:2], end - start, *self.kv.shape[4:])
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != self.dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, need {shape}")
        slots = self.slots(table, start, end, "cpu")
        for shard in self.shards:
            with _on(shard):
                on = slots.to(shard.device, non_blocking=True)
                data = shard.flat().index_select(2, on)
                if shard.scales is not None:
                    data = dequantize_kv(data, shard.flat_scales().index_select(2, on), self.dtype)
                for local, g, n in _runs(shard.layers):
                    out[g : g + n].copy_(data[local : local + n], non_blocking=non_blocking)
        if not non_blocking:
            self.synchronize()
        return out

    def scatter(
        self, table: Sequence[int], start: int, src: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """As `PagePool.scatter`; each device receives its layers on its own stream."""
        end = start + src.shape[2]
        self._check_unshared(table, start, end)
        expected = (*self.kv.shape[:2], end - start, *self.kv.shape[4:])
        if tuple(src.shape) != expected:
            raise ValueError(f"src is {tuple(src.shape)}, need {expected}")
        host_slots = self.slots(table, start, end, "cpu")
        for shard in self.shards:
            with _on(shard):
                slots = host_slots.to(shard.device, non_blocking=True)
                flat = shard.flat()
                for local, g, n in _runs(shard.layers):
                    data = src[g : g + n].to(
                        device=shard.device, dtype=self.dtype, non_blocking=non_blocking
                    )
                    if shard.scales is None:
                        flat[local : local + n].index_copy_(2, slots, data)
                        continue
                    q, scale = quantize_kv(data)
                    flat[local : local + n].index_copy_(2, slots, q)
                    shard.flat_scales()[local : local + n].index_copy_(2, slots, scale)
        if not non_blocking:
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every device's queued copies."""
        for shard in self.shards:
            if shard.stream is not None:
                shard.stream.synchronize()

    def poison(self, device: int) -> None:
        """Fill a device's storage with NaN: what a lost device's pages are worth (tests)."""
        for shard, d in zip(self.shards, self.placement.used(), strict=True):
            if d == device:
                if shard.scales is not None:  # int8 holds no NaN: its scales do
                    shard.scales.fill_(float("nan"))
                else:
                    shard.kv.fill_(float("nan"))


@contextlib.contextmanager
def _on(shard: Shard) -> Iterator[None]:
    """Run a shard's copies on its stream, ordered after the device's work queued so far (the
    forward that wrote the pages) and before the work queued after (the one that reads them)."""
    if shard.stream is None:
        yield
        return
    main = torch.cuda.current_stream(shard.device)
    shard.stream.wait_stream(main)
    with torch.cuda.device(shard.device), torch.cuda.stream(shard.stream):
        yield
    main.wait_stream(shard.stream)


def context_on(ctx: PagedContext, device: torch.device) -> PagedContext:
    """The step's context with its index tensors on `device` (copied once per step and device;
    `ctx` itself where they are there already)."""
    if ctx.slot_mapping.device == device:
        return ctx
    cache: dict[torch.device, PagedContext] = ctx.__dict__.setdefault("_on_device", {})
    hit = cache.get(device)
    if hit is None:
        move = {
            name: getattr(ctx, name).to(device, non_blocking=True)
            for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "slot_mapping")
        }
        for name in ("row_seq", "row_lens", "row_table"):  # the "rows" backend's, when set
            if getattr(ctx, name) is not None:
                move[name] = getattr(ctx, name).to(device, non_blocking=True)
        hit = dataclasses.replace(
            ctx, block_table=ctx.block_table.to(device), decode_rows=None, **move
        )
        cache[device] = hit
    return hit
