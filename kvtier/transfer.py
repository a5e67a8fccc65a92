"""The transfer engine: the one owner of every copy between the tiers (DESIGN.md section 6).

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

Host <-> SSD: two thread pools (writes, reads) call the L3 store, whose O_DIRECT I/O goes
straight between the pinned slots and the .kvbin files. With `writer_process` the writes' file
work runs in a child process that maps the same (shared) L2 slabs (kvtier.tiers.l3_writer). The write queue is bounded: when it is
full, `write_l3` sheds the write (returns None and counts it) instead of stalling decode. A
restore waits for each slot's L3 read just before that chunk's copy, so chunks already read
move to the GPU while later ones are still coming off the disk; a failed read raises there and
its bytes never reach L1.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.codecs import Codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.snapshot import TransferStats
from kvtier.tiers import l3_io
from kvtier.tiers.l1 import block_of
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3_writer import WriterProcess

Layers = Sequence[Sequence[torch.Tensor]]  # per layer (K, V), each [1, H, capacity, D]
DIRECTIONS = (("l1", "l2"), ("l2", "l1"), ("l2", "l3"), ("l3", "l2"))
_DOWN, _UP = ("l1", "l2"), ("l2", "l1")
_ALIGN = 256  # staging rows start on this many bytes (scales are read as float32)
_TIMED_BACKLOG = 256  # timing events kept before they are folded into the totals
GROUP_BYTES = 128 << 20  # default bound of one staging buffer (four per engine on a GPU)
# Beyond 4 chunks a group no longer pays: on the H200 a 2K-token session (8 chunks) moved at
# 0.88 of the copy ceiling with groups of 4 and 0.79 with 8, whose one group nothing overlaps,
# and 8K sessions were the same either way (docs/benchmarks.md, "Transfer").
MAX_GROUP = 4
_WAITERS: dict[int, torch.cuda.Stream] = {}  # per device: the stream `Handle.wait(spin)` syncs


def _done_event() -> torch.cuda.Event:
    """The event a transfer's Handle waits on: it also times the transfer, and it is blocking
    (cudaEventBlockingSync), so a host thread in `wait` (an L3 writer before it writes the
    slot, a caller) sleeps until the copy is done instead of spinning on the driver while the
    decode loop launches kernels. Events only waited on by streams stay non-blocking."""
    return torch.cuda.Event(enable_timing=True, blocking=True)


class Handle:
    """Completion of one GPU<->host transfer: a CUDA event, or nothing left to wait for on CPU."""

    __slots__ = ("_device", "_event", "_keep", "direction")

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        keep: Any = None,
        direction: tuple[str, str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._event = event
        self._device = device  # the event's device (CUDA)
        self._keep = keep  # tensors the copy reads or writes stay alive until it is done
        self.direction = direction

    def done(self) -> bool:
        if self._event is None or self._event.query():
            self._keep = None
            return True
        return False

    def wait(self, spin: bool = False) -> None:
        """Block the calling thread until the copy has finished.

        By default the thread sleeps in the driver (the event is blocking-sync), the right
        wait for a background thread. `spin=True` is for the serving thread when it needs the
        result at once (a restore before the forward): it syncs a side stream that waits on
        the event, which with CUDA's default scheduling spins (the GIL released) and returns
        about 0.2 ms sooner than waking from the blocking event on the H200.
        """
        event = self._event
        if event is not None:
            if spin and self._device is not None:
                index = self._device.index or 0
                waiter = _WAITERS.get(index)
                if waiter is None:
                    waiter = _WAITERS.setdefault(index, torch.cuda.Stream(self._device))
                waiter.wait_event(event)
                waiter.synchronize()
            else:
                event.synchronize()
        self._keep = None

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copy, without blocking the host."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


@dataclass(frozen=True)
class EngineStats:
    """Bytes and seconds per direction, L3 queue depths, shed or failed writes, staging memory."""

    transfers: tuple[TransferStats, ...]
    l3_write_queue: int
    l3_read_queue: int
    shed_writes: int
    l3_write_errors: int
    l3_read_errors: int
    staging_bytes: int = 0


class _Stage:
    """One staging buffer: `group` chunks in the model dtype, plus encoded payload rows for a
    quantizing codec on the GPU. `ready` marks the end of its producer, `free` of its consumer.
    `scratch` is the codec's float32 work buffer, shared by the stages of one direction (one
    stream runs all their encodes, or decodes, one after another)."""

    def __init__(self, engine: TransferEngine, rows: bool, scratch: torch.Tensor | None) -> None:
        g = engine.geometry
        self.geometry = g
        self.chunk_elems = g.chunk_bytes(engine.chunk_tokens) // g.element_size
        self.chunks = torch.empty(
            engine.group_chunks * self.chunk_elems, dtype=g.torch_dtype(), device=engine.device
        )
        self.row_bytes = -(-engine.codec.payload_bytes(engine.chunk_tokens) // _ALIGN) * _ALIGN
        self.rows = (
            torch.empty(
                engine.group_chunks * self.row_bytes, dtype=torch.uint8, device=engine.device
            )
            if rows
            else None
        )
        self.scratch = scratch
        self.ready: Any = torch.cuda.Event() if engine.cuda else None
        self.free: Any = torch.cuda.Event() if engine.cuda else None
        self._views: dict[tuple[int, int, bool], list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of this stage's own buffers (the shared scratch is counted by the engine)."""
        rows = 0 if self.rows is None else self.rows.numel()
        return self.chunks.numel() * self.chunks.element_size() + rows

    def staged(self, count: int, length: int) -> torch.Tensor:
        """The first `count` chunks of `length` tokens: [count, L, P, length, H, D]."""
        shape = self.geometry.chunk_shape(length)
        elems = self.geometry.chunk_bytes(length) // self.geometry.element_size
        return self.chunks[: count * elems].view(count, *shape)

    def payload(self, index: int, length: int, size: int) -> torch.Tensor:
        """Where chunk `index` of a group of `length`-token chunks is encoded (`size` bytes)."""
        if self.rows is not None:
            return self.rows[index * self.row_bytes : index * self.row_bytes + size]
        nbytes = self.geometry.chunk_bytes(length)
        return self.chunks.view(torch.uint8)[index * nbytes : index * nbytes + size]

    def planes(self, count: int, length: int, fused: bool) -> list[torch.Tensor]:
        """The group as `_planes` gives it (views cached per shape)."""
        key = (count, length, fused)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 64:
                self._views.clear()
            views = _planes(self.staged(count, length), fused)
            self._views[key] = views
        return views


def _planes(staged: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    """[count, L, P, n, H, D] as `_l1_views` lays out L1: one view [L*P, H, count, n, D] when
    fused, else L*P views [H, count, n, D], layer-major."""
    planes = staged.permute(1, 2, 4, 0, 3, 5).flatten(0, 1)
    return [planes] if fused else list(planes.unbind(0))


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i, in one call where torch offers it (less launch overhead)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


class TransferEngine:
    """Moves chunks L1 <-> L2 (streams and events) and L2 <-> L3 (thread pools, O_DIRECT)."""

    def __init__(
        self,
        geometry: KVGeometry,
        chunk_tokens: int,
        device: torch.device | str,
        arena: HostArena,
        l3_store: Any | None,
        codec: Codec,
        *,
        l3_write_queue: int = 64,
        l3_threads: int = 4,
        group_chunks: int | None = None,
        writer_process: bool = False,
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
        self.store = l3_store
        self.codec = codec
        self.group_chunks = int(group_chunks)
        self.cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self._ops = dict.fromkeys(DIRECTIONS, 0)
        self._timed: deque[tuple[tuple[str, str], torch.cuda.Event, torch.cuda.Event]] = deque()
        self._slot_copy: dict[int, Handle] = {}  # slot -> last device copy touching it
        self._slot_io: dict[int, tuple[Future[Any], bool]] = {}  # slot -> last L3 I/O, is read
        # L3 jobs queued or running, and failed, by kind ("write", "read")
        self._queued = {"write": 0, "read": 0}
        self._failed = {"write": 0, "read": 0}
        self._writes: set[Future[Any]] = set()
        self._shed = 0
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
        self._writer = ThreadPoolExecutor(
            max(1, l3_threads),
            thread_name_prefix="kvtier-l3w",
            initializer=l3_io.background_thread,  # below the decode loop's CPU priority
        )
        self._reader = ThreadPoolExecutor(
            max(1, l3_threads),
            thread_name_prefix="kvtier-l3r",
            initializer=l3_io.background_thread,
            initargs=(False,),  # a restore waits for reads: normal priority, off the serving core
        )
        self.l3_write_queue = int(l3_write_queue)
        self._proc: WriterProcess | None = None
        if writer_process and l3_store is not None:
            if not arena.shared:
                raise ConfigError("writer_process needs an L2 arena built with shared=True")
            self._proc = WriterProcess(arena.slabs(), threads=l3_threads)

    @property
    def l3_writer(self) -> str:
        """Where this engine's L3 file writes run: "process" or "threads"."""
        return "threads" if self._proc is None else "process"

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
            self._settle_io(slot)  # an L3 write still reading the slot finishes first
        with self._issue[_DOWN]:
            if self.cuda:
                handle = self._offload_cuda(layers, block, start, ntokens, slots)
            else:
                t0 = time.perf_counter()
                moved = self._offload_cpu(layers, block, start, ntokens, slots)
                handle = Handle(direction=_DOWN)
                self._account(_DOWN, moved, time.perf_counter() - t0, len(slots))
            for slot in slots:
                self._slot_copy[slot] = handle
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
        for pair in layers:
            for t in pair:
                t.record_stream(gather)
        self._timing(_DOWN, begin, end, moved, len(slots))
        return Handle(end, keep=(layers,), direction=_DOWN, device=self.device)

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
        with self._issue[_UP]:
            if self.cuda:
                return self._restore_cuda(slots, ntokens, layers, block, start)
            t0 = time.perf_counter()
            handle = Handle(direction=_UP)
            try:
                moved = self._restore_cpu(slots, ntokens, layers, block, start)
            finally:
                for slot in slots:
                    self._slot_copy[slot] = handle
            self._account(_UP, moved, time.perf_counter() - t0, len(slots))
            return handle

    def _restore_cuda(
        self,
        slots: Sequence[int],
        ntokens: int,
        layers: Layers,
        block: torch.Tensor | None,
        start: int,
    ) -> Handle:
        scatter, copy = self._streams[_UP]
        scatter.wait_stream(torch.cuda.current_stream(self.device))  # L1 is free to overwrite
        begin = torch.cuda.Event(enable_timing=True)
        end = _done_event()
        begin.record(copy)
        moved = 0
        n = self.chunk_tokens
        try:
            for index, count, length in self._groups(ntokens, len(slots), self.group_chunks):
                stage = self._next_stage(_UP)
                size = self.codec.payload_bytes(length)
                copy.wait_event(stage.free)  # its previous group has been scattered
                with torch.cuda.stream(copy):
                    for c in range(count):
                        slot = slots[index + c]
                        self._settle_io(slot, strict=True)
                        self._after(slot, _DOWN, copy)  # an offload still filling the slot
                        src = self.arena.view(slot)[:size]
                        stage.payload(c, length, size).copy_(src, non_blocking=True)
                        moved += size
                    stage.ready.record(copy)
                scatter.wait_event(stage.ready)
                with torch.cuda.stream(scatter):
                    if not self.codec.lossless:
                        staged = stage.staged(count, length)
                        for c in range(count):
                            payload = stage.payload(c, length, size)
                            self.codec.decode(payload, length, out=staged[c], scratch=stage.scratch)
                    views, fused = self._l1_views(layers, block, start + index * n, count, length)
                    _copy_all(views, stage.planes(count, length, fused))
                    stage.free.record(scatter)
        finally:
            scatter.wait_stream(copy)  # `end` covers every copy issued, even after an error
            end.record(scatter)
            for pair in layers:
                for t in pair:
                    t.record_stream(scatter)
            handle = Handle(end, keep=(layers,), direction=_UP, device=self.device)
            for slot in slots:
                self._slot_copy[slot] = handle
        self._timing(_UP, begin, end, moved, len(slots))
        return handle

    def _restore_cpu(
        self,
        slots: Sequence[int],
        ntokens: int,
        layers: Layers,
        block: torch.Tensor | None,
        start: int,
    ) -> int:
        n = self.chunk_tokens
        moved = 0
        native = self.codec.lossless
        group = 1 if native else self.group_chunks
        for index, count, length in self._groups(ntokens, len(slots), group):
            size = self.codec.payload_bytes(length)
            views, fused = self._l1_views(layers, block, start + index * n, count, length)
            if native:  # scatter straight from the slot
                self._settle_io(slots[index], strict=True)
                chunk = self._slot_chunk(slots[index], length).unsqueeze(0)
                _copy_all(views, _planes(chunk, fused))
                moved += size
                continue
            stage = self._stages[_UP][0]
            staged = stage.staged(count, length)
            for c in range(count):
                slot = slots[index + c]
                self._settle_io(slot, strict=True)
                payload = self.arena.view(slot)[:size]
                self.codec.decode(payload, length, out=staged[c], scratch=stage.scratch)
                moved += size
            _copy_all(views, stage.planes(count, length, fused))
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
        handle = self._slot_copy.get(slot)
        if handle is not None and handle.direction == direction and handle._event is not None:
            stream.wait_event(handle._event)

    def _slot_chunk(self, slot: int, length: int) -> torch.Tensor:
        shape = self.geometry.chunk_shape(length)
        nbytes = self.geometry.chunk_bytes(length)
        return self.arena.view(slot)[:nbytes].view(self.geometry.torch_dtype()).view(shape)

    def _l1_views(
        self, layers: Layers, block: torch.Tensor | None, first: int, count: int, length: int
    ) -> tuple[list[torch.Tensor], bool]:
        """Tokens [first, first + count*length) of every layer and plane, and whether fused.

        Fused (`block`, L1Pool's one-allocation layout): one view [L*P, H, count, length, D],
        moved by one copy. Otherwise one view [H, count, length, D] per layer and plane,
        layer-major.
        """
        planes = self.geometry.kv_planes
        if block is not None:
            span = block[:, :planes, 0].flatten(0, 1)[:, :, first : first + count * length]
            return [span.unflatten(2, (count, length))], True
        views = []
        for pair in layers:
            for t in pair[:planes]:
                s = t.stride()
                views.append(
                    t.as_strided(
                        (t.shape[1], count, length, t.shape[3]),
                        (s[1], length * s[2], s[2], s[3]),
                        t.storage_offset() + first * s[2],
                    )
                )
        return views, False

    def _check_range(
        self,
        layers: Layers,
        start: int,
        ntokens: int,
        slots: Sequence[int],
        block: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Refuse a range that does not fit; returns the L1 block behind `layers`, if any.

        A `block` given by the caller (L1Pool's, with its views as `layers`) is checked in
        O(1); without one, every layer is checked and the block is looked for
        (`l1.block_of`), which costs tens of microseconds per call on a 28-layer model.
        """
        if self._closed:
            raise ConfigError("the transfer engine is closed")
        g = self.geometry
        if len(layers) != g.num_layers:
            raise ConfigError(f"got {len(layers)} layers but the geometry has {g.num_layers}")
        n = self.chunk_tokens
        if ntokens <= 0 or not slots or -(-ntokens // n) != len(slots):
            raise ConfigError(
                f"{ntokens} tokens need {-(-ntokens // n)} slots of {n} tokens, got {len(slots)}"
            )
        end = start + ntokens
        if block is not None:
            if not (
                block.dim() == 6
                and block.shape[0] == g.num_layers
                and layers[0][0]._base is block
                and layers[-1][g.kv_planes - 1]._base is block
            ):
                raise ConfigError("block is not the L1Pool block these layers are views of")
            tensors: Sequence[torch.Tensor] = [block[0, 0]]
        else:
            tensors = [t for pair in layers for t in pair[: g.kv_planes]]
        for t in tensors:
            if (
                t.dim() != 4
                or t.shape[1] != g.num_kv_heads
                or t.shape[3] != g.head_dim
                or not 0 <= start <= end <= t.shape[2]
                or t.device != self.device
            ):
                raise ConfigError(
                    f"tokens [{start}, {end}) do not fit an L1 buffer of shape "
                    f"{tuple(t.shape)} on {t.device}; expected [1, {g.num_kv_heads}, "
                    f">= {end}, {g.head_dim}] on {self.device}"
                )
        return block if block is not None else block_of(layers)

    # ---- L2 <-> L3 ---------------------------------------------------------------------------

    def write_l3(self, slot: int, header: Any) -> Future[Any] | None:
        """Queue the chunk in `slot` for a durable L3 write; None when shed (queue full)."""
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to write to SSD")
        with self._lock:
            if self._queued["write"] >= self.l3_write_queue:
                self._shed += 1
                return None
            self._queued["write"] += 1
        copy = self._slot_copy.get(slot)
        try:
            future = self._writer.submit(self._write, slot, header, copy)
        except BaseException:
            with self._lock:
                self._queued["write"] -= 1
            raise
        self._slot_io[slot] = (future, False)
        with self._lock:
            self._writes.add(future)
        future.add_done_callback(self._write_done)
        return future

    def _write_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._writes.discard(future)

    def _write(self, slot: int, header: Any, copy: Handle | None) -> Any:
        def put() -> Any:
            payload = self.arena.buffer(slot)[: header.payload_len]
            return self._need_store().put(header, payload, writer=self._temp_writer(slot))

        return self._l3_job("write", copy, put)

    def _l3_job(self, kind: str, copy: Handle | None, work: Any) -> Any:
        """Run one L3 write or read on a pool thread: wait for the device copy still using
        the slot, time the I/O, and keep the queue and failure counts of `kind`."""
        direction = ("l2", "l3") if kind == "write" else ("l3", "l2")
        try:
            if copy is not None:
                copy.wait()  # the slot's device copy finishes before the disk touches the slot
            t0 = time.perf_counter()
            header = work()
            self._account(direction, header.payload_len, time.perf_counter() - t0, 1)
            return header
        except BaseException:
            with self._lock:
                self._failed[kind] += 1
            raise
        finally:
            with self._lock:
                self._queued[kind] -= 1

    def _temp_writer(self, slot: int) -> Any:
        """For `L3Store.put`: the writer process writes the slot's bytes, or None (threads)."""
        proc = self._proc
        if proc is None:
            return None
        slab, offset = self.arena.locate(slot)

        def write(header: Any, tmp: str, direct: bool, keep: bool) -> Any:
            return proc.write(slab, offset, header.payload_len, header, tmp, direct, keep)

        return write

    def read_l3(self, key: bytes, slot: int, fingerprint: bytes) -> Future[Any]:
        """Read chunk `key` from L3 into `slot` (O_DIRECT); the future yields its ChunkHeader.

        A checksum, fingerprint or I/O failure comes back as the future's exception (and from
        a restore of that slot): the caller treats it as a miss and recomputes; no byte of it
        reaches the GPU.
        """
        self._need_store()  # fail in the caller, not in the pool thread
        self._settle_io(slot)
        copy = self._slot_copy.get(slot)
        with self._lock:
            self._queued["read"] += 1
        future = self._reader.submit(self._read, key, slot, fingerprint, copy)
        self._slot_io[slot] = (future, True)
        return future

    def _read(self, key: bytes, slot: int, fingerprint: bytes, copy: Handle | None) -> Any:
        def get() -> Any:
            return self._need_store().get(key, self.arena.buffer(slot), fingerprint=fingerprint)

        return self._l3_job("read", copy, get)

    def _need_store(self) -> Any:
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to use the SSD tier")
        return self.store

    def _settle_io(self, slot: int, strict: bool = False) -> None:
        """Wait for L3 I/O on `slot` before a device copy touches it.

        A failed write stays with its future. A failed read leaves the slot's bytes unusable:
        with `strict` (a copy about to read the slot) its error is raised here, and a write
        still in flight is left running (it only reads the slot too, so a restore need not
        wait for the disk).
        """
        entry = self._slot_io.get(slot)
        if entry is None:
            return
        future, is_read = entry
        if strict and not is_read and not future.done():
            return
        self._slot_io.pop(slot, None)
        error = future.exception()
        if strict and is_read and error is not None:
            raise error

    def busy(self, slot: int) -> bool:
        """Whether a copy or L3 I/O on `slot` may still be running (do not free it yet)."""
        copy = self._slot_copy.get(slot)
        io = self._slot_io.get(slot)
        return (copy is not None and not copy.done()) or (io is not None and not io[0].done())

    def forget(self, slot: int) -> None:
        """Wait for everything on `slot`, then drop its tracking (call before freeing it)."""
        copy = self._slot_copy.pop(slot, None)
        if copy is not None:
            copy.wait()
        self._settle_io(slot)

    def flush(self) -> None:
        """Wait until every queued L3 write has finished (successfully or not)."""
        with self._lock:
            pending = list(self._writes)
        for future in pending:
            future.exception()

    # ---- accounting --------------------------------------------------------------------------

    def _account(self, direction: tuple[str, str], nbytes: int, seconds: float, ops: int) -> None:
        with self._lock:
            self._bytes[direction] += nbytes
            self._seconds[direction] += seconds
            self._ops[direction] += ops

    def _timing(
        self,
        direction: tuple[str, str],
        begin: torch.cuda.Event,
        end: torch.cuda.Event,
        nbytes: int,
        ops: int,
    ) -> None:
        """Count a device transfer now; its seconds once its events have completed."""
        with self._lock:
            self._timed.append((direction, begin, end))
            self._bytes[direction] += nbytes
            self._ops[direction] += ops
            backlog = len(self._timed) > _TIMED_BACKLOG
        if backlog:
            self._collect_timings()

    def _collect_timings(self) -> None:
        with self._lock:
            while self._timed and self._timed[0][2].query():
                direction, begin, end = self._timed.popleft()
                self._seconds[direction] += begin.elapsed_time(end) / 1000.0

    def stats(self) -> EngineStats:
        self._collect_timings()
        with self._lock:
            return EngineStats(
                transfers=tuple(
                    TransferStats(
                        src,
                        dst,
                        self._bytes[src, dst],
                        self._seconds[src, dst],
                        self._ops[src, dst],
                    )
                    for src, dst in DIRECTIONS
                ),
                l3_write_queue=self._queued["write"],
                l3_read_queue=self._queued["read"],
                shed_writes=self._shed,
                l3_write_errors=self._failed["write"],
                l3_read_errors=self._failed["read"],
                staging_bytes=self.staging_bytes,
            )

    def synchronize(self) -> None:
        """Wait for every device copy issued so far."""
        for streams in self._streams.values():
            for stream in streams:
                if stream is not None:
                    stream.synchronize()

    def close(self) -> None:
        """Finish queued L3 writes (never drop stored data), then stop. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self._proc is not None:
            self._proc.close()
        self._slot_copy.clear()
        self._slot_io.clear()
        self._stages = {_DOWN: [], _UP: []}

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
