"""The device mover: every copy between the L1 views and the L2 slots.

See docs/architecture.md, "Movement and policy".

GPU <-> host moves chunks in groups of `group_chunks`. Restore copies a group from its pinned
L2 slots into one contiguous device staging buffer `[G, layer, k|v, token, head, dim]` on a
copy stream, then scatters the whole group into the per-layer L1 buffers on a second stream,
one copy per layer and plane. Two staging buffers per direction alternate, guarded by events,
so the PCIe copy of group g+1 runs while group g is scattered. Offload is the mirror: gather a
group on a gather stream, then one device-to-host copy per chunk on the copy stream while the
next group is gathered. Quantizing codecs encode (decode) each chunk in the staging buffer, on
the device, before the copy down (after the copy up). The two directions share no stream,
buffer or lock, so one session goes down while another comes up. The staging memory is
allocated once, at construction, and reported as `staging_bytes`.

On a CPU device the same code runs synchronously; with the native codec it gathers straight
into the slot and scatters straight from it (no staging copy).

A copy on a slot first settles the disk mover's I/O on it, in the `SlotOrder` the movers share
(kvtier.transfer.slots): a restore waits there for the slot's L3 read, and a failed read raises
there. The copies issued on each slot are recorded there for the disk mover in turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvtier.codecs import Codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.tiers.l2 import HostArena
from kvtier.transfer.accounting import Accounts
from kvtier.transfer.layout import Layers, check_range, l1_views
from kvtier.transfer.slots import SlotOrder
from kvtier.transfer.staging import Handle, _copy_all, _done_event, _planes, _Stage

_DOWN, _UP = ("l1", "l2"), ("l2", "l1")
GROUP_BYTES = 128 << 20  # default bound of one staging buffer (four per engine on a GPU)
# Beyond 4 chunks a group no longer pays: on the H200 a 2K-token session (8 chunks) moved at
# 0.88 of the copy ceiling with groups of 4 and 0.79 with 8, whose one group nothing overlaps,
# and 8K sessions were the same either way (docs/benchmarks.md, "Transfer").
MAX_GROUP = 4


class DeviceMover:
    """Moves chunks L1 <-> L2: CUDA streams, staging buffers and events (or CPU copies)."""

    def __init__(
        self,
        geometry: KVGeometry,
        chunk_tokens: int,
        device: torch.device | str,
        arena: HostArena,
        codec: Codec,
        accounts: Accounts,
        order: SlotOrder,
        *,
        group_chunks: int | None = None,
    ) -> None:
        if chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
        if group_chunks is None:
            per_chunk = max(1, geometry.chunk_bytes(chunk_tokens))
            group_chunks = max(1, min(MAX_GROUP, GROUP_BYTES // per_chunk))
        if group_chunks <= 0:
            raise ConfigError(f"group_chunks must be positive, got {group_chunks}")
        if codec.geometry != geometry:
            raise ConfigError(
                "the codec was made for another KVGeometry; use make_codec(name, geometry)"
            )
        need = codec.payload_bytes(chunk_tokens)
        if need > arena.slot_bytes:
            raise ConfigError(
                f"a {codec.name} chunk of {chunk_tokens} tokens needs {need} bytes but L2 slots "
                f"hold {arena.slot_bytes}; size the arena with slot_bytes >= payload_bytes"
            )
        self.geometry = geometry
        self.chunk_tokens = int(chunk_tokens)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.arena = arena
        self.codec = codec
        self.group_chunks = int(group_chunks)
        self.cuda = self.device.type == "cuda"
        self._accounts = accounts
        self._order = order  # each slot's last device copy, and the disk mover's I/O on it
        self._closed = False
        # Per direction: an issue lock (held only while launching), streams, staging buffers.
        self._issue = {_DOWN: threading.Lock(), _UP: threading.Lock()}
        self._streams: dict[tuple[str, str], tuple[Any, Any]] = {
            _DOWN: (None, None),
            _UP: (None, None),
        }
        self._stages: dict[tuple[str, str], list[_Stage]] = {_DOWN: [], _UP: []}
        self._turn = {_DOWN: 0, _UP: 0}
        if self.cuda:
            with torch.cuda.device(self.device):
                # (device-side stream, copy stream): gather + D2H down, H2D + scatter up
                self._streams[_DOWN] = (
                    torch.cuda.Stream(self.device),
                    torch.cuda.Stream(self.device),
                )
                self._streams[_UP] = (
                    torch.cuda.Stream(self.device),
                    torch.cuda.Stream(self.device),
                )
                for direction in (_DOWN, _UP):
                    scratch = self._codec_scratch()
                    stages = [_Stage(self, not codec.lossless, scratch) for _ in range(2)]
                    # the allocator must see their use on the side streams
                    for t in (scratch, *(b for s in stages for b in (s.chunks, s.rows))):
                        for stream in self._streams[direction]:
                            if t is not None:
                                t.record_stream(stream)
                    self._stages[direction] = stages
        elif not codec.lossless:
            self._stages = {
                _DOWN: [_Stage(self, False, self._codec_scratch())],
                _UP: [_Stage(self, False, self._codec_scratch())],
            }

    def _codec_scratch(self) -> torch.Tensor | None:
        """The codec's float32 work buffer for one direction, so that quantizing allocates
        nothing on the side streams; None for the native codec."""
        elems = self.codec.scratch_elems(self.chunk_tokens)
        return torch.empty(elems, dtype=torch.float32, device=self.device) if elems else None

    @property
    def staging_bytes(self) -> int:
        """Device (or host, on CPU) memory the staging buffers hold, for the L1 budget."""
        total = 0
        for stages in self._stages.values():
            total += sum(stage.nbytes for stage in stages)
            if stages and stages[0].scratch is not None:  # one per direction
                total += stages[0].scratch.numel() * stages[0].scratch.element_size()
        return total

    # ---- L1 <-> L2 ---------------------------------------------------------------------------

    def offload(
        self,
        layers: Layers,
        start: int,
        ntokens: int,
        slot: int,
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy tokens [start, start+ntokens) of every layer into L2 `slot` (one chunk)."""
        return self.offload_range(layers, start, ntokens, [slot], block=block)

    def offload_range(
        self,
        layers: Layers,
        start: int,
        ntokens: int,
        slots: Sequence[int],
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy tokens [start, start+ntokens) into consecutive chunks, one per slot.

        Every chunk but the last is full. The device side gathers `group_chunks` chunks per
        copy (one for all layers and planes when `layers` are views of one L1Pool block, else
        one per layer and plane); each chunk then goes down in one copy into its slot. `block`
        is that block (`SessionBuffers.block`), which spares finding it again.
        """
        block = self._check_range(layers, start, ntokens, slots, block)
        for slot in slots:
            self._order.settle_io(slot)  # an L3 write still reading the slot finishes first
        with self._issue[_DOWN]:
            if self.cuda:
                handle = self._offload_cuda(layers, block, start, ntokens, slots)
            else:
                t0 = time.perf_counter()
                moved = self._offload_cpu(layers, block, start, ntokens, slots)
                handle = Handle(direction=_DOWN)
                self._accounts.account(_DOWN, moved, time.perf_counter() - t0, len(slots))
            for slot in slots:
                self._order.copied(slot, handle)
        return handle

    def _offload_cuda(
        self,
        layers: Layers,
        block: torch.Tensor | None,
        start: int,
        ntokens: int,
        slots: Sequence[int],
    ) -> Handle:
        gather, copy = self._streams[_DOWN]
        gather.wait_stream(torch.cuda.current_stream(self.device))  # L1 holds its final values
        begin = torch.cuda.Event(enable_timing=True)
        end = _done_event()
        begin.record(gather)
        moved = 0
        n = self.chunk_tokens
        for index, count, length in self._groups(ntokens, len(slots), self.group_chunks):
            stage = self._next_stage(_DOWN)
            size = self.codec.payload_bytes(length)
            gather.wait_event(stage.free)  # its previous chunks have gone down
            with torch.cuda.stream(gather):
                views, fused = self._l1_views(layers, block, start + index * n, count, length)
                _copy_all(stage.planes(count, length, fused), views)
                if not self.codec.lossless:
                    staged = stage.staged(count, length)
                    for c in range(count):
                        out = stage.payload(c, length, size)
                        self.codec.encode(staged[c], out=out, scratch=stage.scratch)
                stage.ready.record(gather)
            copy.wait_event(stage.ready)
            with torch.cuda.stream(copy):
                for c in range(count):
                    slot = slots[index + c]
                    self._after(slot, _UP, copy)  # a restore still reading the slot
                    dst = self.arena.view(slot)[:size]
                    dst.copy_(stage.payload(c, length, size), non_blocking=True)
                    moved += size
                stage.free.record(copy)
        end.record(copy)
        _record_use(layers, block, gather)
        self._accounts.timing(_DOWN, begin, end, moved, len(slots))
        # No reference to the L1 buffers: `_record_use` keeps the allocator from reusing them
        # before the copy is done, and a handle kept for its slot (or by a queued L3 write)
        # must not keep a released session's whole block alive (see kvtier.transfer.inflight).
        return Handle(end, direction=_DOWN, device=self.device)

    def _offload_cpu(
        self,
        layers: Layers,
        block: torch.Tensor | None,
        start: int,
        ntokens: int,
        slots: Sequence[int],
    ) -> int:
        n = self.chunk_tokens
        moved = 0
        native = self.codec.lossless
        group = 1 if native else self.group_chunks
        for index, count, length in self._groups(ntokens, len(slots), group):
            views, fused = self._l1_views(layers, block, start + index * n, count, length)
            if native:  # gather straight into the slot, no staging copy
                chunk = self._slot_chunk(slots[index], length).unsqueeze(0)
                _copy_all(_planes(chunk, fused), views)
                moved += self.geometry.chunk_bytes(length)
                continue
            stage = self._stages[_DOWN][0]
            _copy_all(stage.planes(count, length, fused), views)
            staged = stage.staged(count, length)
            for c in range(count):  # encode straight into the slot
                out = self.arena.view(slots[index + c])
                moved += self.codec.encode(staged[c], out=out, scratch=stage.scratch).numel()
        return moved

    def offload_chunk(self, chunk: torch.Tensor, slot: int) -> Handle:
        """Copy one chunk that is already in the chunk layout (`[layer, k|v, token, head, dim]`,
        contiguous, on this device: a batch's pages gathered by `PagePool.gather`) into L2
        `slot`. Native codec only: the slot takes the bytes as they are."""
        if not self.codec.lossless or self.codec.payload_bytes(1) != self.geometry.chunk_bytes(1):
            raise ConfigError("offload_chunk copies raw K/V: it needs the native codec")
        length = int(chunk.shape[2])
        if tuple(chunk.shape) != self.geometry.chunk_shape(length) or length > self.chunk_tokens:
            raise ValueError(
                f"chunk is {tuple(chunk.shape)}, need a chunk_shape of <= "
                f"{self.chunk_tokens} tokens"
            )
        if self._closed:
            raise ConfigError("the transfer engine is closed")
        self._order.settle_io(slot)  # an L3 write still reading the slot finishes first
        dst = self._slot_chunk(slot, length)
        with self._issue[_DOWN]:
            if not self.cuda:
                t0 = time.perf_counter()
                dst.copy_(chunk)
                handle = Handle(direction=_DOWN)
                self._accounts.account(
                    _DOWN, dst.numel() * dst.element_size(), time.perf_counter() - t0, 1
                )
            else:
                _, copy = self._streams[_DOWN]
                copy.wait_stream(torch.cuda.current_stream(self.device))  # chunk is written
                begin = torch.cuda.Event(enable_timing=True)
                end = _done_event()
                begin.record(copy)
                with torch.cuda.stream(copy):
                    self._after(slot, _UP, copy)  # a restore still reading the slot
                    dst.copy_(chunk, non_blocking=True)
                end.record(copy)
                chunk.record_stream(copy)  # not reused before the copy is done; no reference
                handle = Handle(end, direction=_DOWN, device=self.device)
                self._accounts.timing(_DOWN, begin, end, dst.numel() * dst.element_size(), 1)
            self._order.copied(slot, handle)
        return handle

    def restore(
        self,
        slot: int,
        ntokens: int,
        layers: Layers,
        start: int,
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy the chunk in L2 `slot` into tokens [start, start+ntokens) of every layer."""
        return self.restore_range([slot], ntokens, layers, start, block=block)

    def restore_range(
        self,
        slots: Sequence[int],
        ntokens: int,
        layers: Layers,
        start: int,
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy consecutive chunks (every one full but the last) back into the L1 layers.

        A slot with an L3 read in flight is waited for just before its own copy, so a restore
        issued right after `read_l3` overlaps the disk with the copies. A failed read raises
        its error here (the chunks before it may already be in L1; the caller recomputes).
        `block` as for `offload_range`.
        """
        block = self._check_range(layers, start, ntokens, slots, block)
        n = self.chunk_tokens

        def put(index: int, count: int, length: int, staged: Any, stage: Any) -> None:
            views, fused = self._l1_views(layers, block, start + index * n, count, length)
            _copy_all(
                views,
                _planes(staged, fused) if stage is None else stage.planes(count, length, fused),
            )

        return self._restore(slots, ntokens, put, (layers, block))

    def restore_chunks(
        self, slots: Sequence[int], ntokens: int, write: Callable[[int, torch.Tensor], None]
    ) -> Handle:
        """Copy consecutive chunks (every one full but the last) out of their L2 slots for
        `write`, which gets (first token, `[count, layer, k|v, token, head, dim]` on the device)
        and copies them where they go (a batch's page pool) on the current stream, on a CUDA
        device a side stream ordered after the caller's. The tensor is a staging buffer, reused
        after `write` returns. Where `restore_range` lands chunks in L1 buffers, this lands them
        anywhere, with the same one copy per chunk over PCIe. The caller orders its readers
        after the returned handle (`Handle.wait_stream`)."""
        if self._closed:
            raise ConfigError("the transfer engine is closed")
        n = self.chunk_tokens
        if ntokens <= 0 or not slots or -(-ntokens // n) != len(slots):
            raise ConfigError(
                f"{ntokens} tokens need {-(-ntokens // n)} slots of {n} tokens, got {len(slots)}"
            )

        def put(index: int, count: int, length: int, staged: Any, stage: Any) -> None:
            write(index * n, staged)

        return self._restore(slots, ntokens, put, None)

    def _restore(
        self, slots: Sequence[int], ntokens: int, put: Callable[..., None], l1: Any
    ) -> Handle:
        """The restore loop of `restore_range` and `restore_chunks`: `put(first chunk, chunks,
        tokens per chunk, staged chunks, stage or None)` lands each group. `l1`: the L1
        (layers, block) written, which the copies' stream must keep alive."""
        with self._issue[_UP]:
            if self.cuda:
                return self._restore_cuda(slots, ntokens, put, l1)
            t0 = time.perf_counter()
            handle = Handle(direction=_UP)
            try:
                moved = self._restore_cpu(slots, ntokens, put)
            finally:
                for slot in slots:
                    self._order.copied(slot, handle)
            self._accounts.account(_UP, moved, time.perf_counter() - t0, len(slots))
            return handle

    def _restore_cuda(
        self, slots: Sequence[int], ntokens: int, put: Callable[..., None], l1: Any
    ) -> Handle:
        scatter, copy = self._streams[_UP]
        scatter.wait_stream(torch.cuda.current_stream(self.device))  # free to overwrite
        begin = torch.cuda.Event(enable_timing=True)
        end = _done_event()
        begin.record(copy)
        moved = 0
        try:
            for index, count, length in self._groups(ntokens, len(slots), self.group_chunks):
                stage = self._next_stage(_UP)
                size = self.codec.payload_bytes(length)
                copy.wait_event(stage.free)  # its previous group has been scattered
                with torch.cuda.stream(copy):
                    for c in range(count):
                        slot = slots[index + c]
                        self._order.settle_io(slot, strict=True)
                        self._after(slot, _DOWN, copy)  # an offload still filling the slot
                        src = self.arena.view(slot)[:size]
                        stage.payload(c, length, size).copy_(src, non_blocking=True)
                        moved += size
                    stage.ready.record(copy)
                scatter.wait_event(stage.ready)
                with torch.cuda.stream(scatter):
                    staged = stage.staged(count, length)
                    if not self.codec.lossless:
                        for c in range(count):
                            payload = stage.payload(c, length, size)
                            self.codec.decode(payload, length, out=staged[c], scratch=stage.scratch)
                    put(index, count, length, staged, stage)
                    stage.free.record(scatter)
        finally:
            scatter.wait_stream(copy)  # `end` covers every copy issued, even after an error
            end.record(scatter)
            if l1 is not None:  # as for an offload: the allocator, not the handle, keeps L1
                _record_use(l1[0], l1[1], scatter)
            handle = Handle(end, direction=_UP, device=self.device)
            for slot in slots:
                self._order.copied(slot, handle)
        self._accounts.timing(_UP, begin, end, moved, len(slots))
        return handle

    def _restore_cpu(self, slots: Sequence[int], ntokens: int, put: Callable[..., None]) -> int:
        moved = 0
        native = self.codec.lossless
        group = 1 if native else self.group_chunks
        for index, count, length in self._groups(ntokens, len(slots), group):
            size = self.codec.payload_bytes(length)
            if native:  # straight from the slot
                self._order.settle_io(slots[index], strict=True)
                put(index, count, length, self._slot_chunk(slots[index], length).unsqueeze(0), None)
                moved += size
                continue
            stage = self._stages[_UP][0]
            staged = stage.staged(count, length)
            for c in range(count):
                slot = slots[index + c]
                self._order.settle_io(slot, strict=True)
                payload = self.arena.view(slot)[:size]
                self.codec.decode(payload, length, out=staged[c], scratch=stage.scratch)
                moved += size
            put(index, count, length, staged, stage)
        return moved

    # ---- groups, views -----------------------------------------------------------------------

    def _groups(self, ntokens: int, nslots: int, group: int) -> Iterator[tuple[int, int, int]]:
        """(first chunk, chunks, tokens per chunk): full chunks by `group`, the partial alone."""
        n = self.chunk_tokens
        full = ntokens // n
        index = 0
        while index < full:
            count = min(group, full - index)
            yield index, count, n
            index += count
        if full < nslots:
            yield full, 1, ntokens - full * n

    def _next_stage(self, direction: tuple[str, str]) -> _Stage:
        stages = self._stages[direction]
        turn = self._turn[direction]
        self._turn[direction] = (turn + 1) % len(stages)
        return stages[turn]

    def _after(self, slot: int, direction: tuple[str, str], stream: torch.cuda.Stream) -> None:
        """Order `stream` after the last copy of the other direction on `slot` (GPU-side)."""
        handle = self._order.last_copy(slot)
        if handle is not None and handle.direction == direction:
            handle.wait_stream(stream)

    def _slot_chunk(self, slot: int, length: int) -> torch.Tensor:
        shape = self.geometry.chunk_shape(length)
        nbytes = self.geometry.chunk_bytes(length)
        return self.arena.view(slot)[:nbytes].view(self.geometry.torch_dtype()).view(shape)

    def _l1_views(
        self, layers: Layers, block: torch.Tensor | None, first: int, count: int, length: int
    ) -> tuple[list[torch.Tensor], bool]:
        """Tokens [first, first + count*length) of every layer and plane (`layout.l1_views`)."""
        return l1_views(self.geometry, layers, block, first, count, length)

    def _check_range(
        self,
        layers: Layers,
        start: int,
        ntokens: int,
        slots: Sequence[int],
        block: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Refuse a range that does not fit, or any once closed (`layout.check_range`)."""
        if self._closed:
            raise ConfigError("the transfer engine is closed")
        return check_range(
            self.geometry, self.chunk_tokens, self.device, layers, start, ntokens, slots, block
        )

    # ---- slots, accounting, lifetime ---------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every device copy issued so far."""
        for streams in self._streams.values():
            for stream in streams:
                if stream is not None:
                    stream.synchronize()

    def close(self) -> None:
        """Refuse new copies and wait for those issued."""
        self._closed = True
        self.synchronize()

    def free(self) -> None:
        """Drop the staging buffers (after `close`)."""
        self._stages = {_DOWN: [], _UP: []}

    def abandon(self) -> None:
        """A lost or replaced device: never wait for its streams again, and drop its buffers
        (the engine forgets its copies in the slots' order)."""
        self._closed = True
        self.free()

    def unfinished_copies(self) -> set[int]:
        """L2 slots whose last device-to-host copy did not complete (the device failed under
        it): their bytes may be partial. On a device that still works every copy completes
        here. Forgets every slot's copy."""
        out = set()
        for slot, handle in self._order.take_copies().items():
            if handle.direction != ("l1", "l2"):
                continue
            try:
                handle.wait()
            except Exception:  # a lost GPU raises from its events
                out.add(slot)
        return out


def _record_use(layers: Layers, block: torch.Tensor | None, stream: torch.cuda.Stream) -> None:
    """Tell the allocator that `stream` uses the L1 memory (no reuse before its work is done).

    The allocator tracks a whole allocation, so the views of one block take one call, not one
    per layer and plane: 56 calls for a 28-layer model were the hottest lines of the restore
    and commit threads in the 256-session fleet (`bench/stacks.py`), under the issue lock."""
    if block is not None:
        block.record_stream(stream)
        return
    for pair in layers:
        for t in pair:
            t.record_stream(stream)
