"""The transfer engine: the one owner of every copy between the tiers (DESIGN.md section 6).

GPU <-> host: a chunk is gathered from the per-layer L1 buffers into a contiguous staging
buffer on the device (device-to-device), encoded there by the codec, and moved with ONE copy
into its pinned L2 slot on a dedicated stream (one stream down, one up, so both directions run
at once); an event marks completion. Restore is the reverse. On a CPU device the same code runs
synchronously and gathers straight into the slot when the codec is native (one copy, no staging).

Host <-> SSD: two thread pools (writes, reads) call the L3 store, whose O_DIRECT I/O goes
straight between the pinned slots and the .kvbin files. The write queue is bounded: when it is
full, `write_l3` sheds the write (returns None and counts it) instead of stalling decode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.codecs import Codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.snapshot import TransferStats
from kvtier.tiers.l2 import HostArena

Layers = Sequence[Sequence[torch.Tensor]]  # per layer (K, V), each [1, H, capacity, D]
DIRECTIONS = (("l1", "l2"), ("l2", "l1"), ("l2", "l3"), ("l3", "l2"))


class Handle:
    """Completion of one GPU<->host transfer: a CUDA event, or nothing left to wait for on CPU."""

    __slots__ = ("_event", "_keep")

    def __init__(self, event: torch.cuda.Event | None = None, keep: Any = None) -> None:
        self._event = event
        self._keep = keep  # tensors the copy reads or writes stay alive until it is done

    def done(self) -> bool:
        if self._event is None or self._event.query():
            self._keep = None
            return True
        return False

    def wait(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self._event is not None:
            self._event.synchronize()
        self._keep = None

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copy, without blocking the host."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._event.device)).wait_event(self._event)


@dataclass(frozen=True)
class EngineStats:
    """Bytes and seconds per direction, L3 queue depths and shed or failed writes."""

    transfers: tuple[TransferStats, ...]
    l3_write_queue: int
    l3_read_queue: int
    shed_writes: int
    l3_write_errors: int
    l3_read_errors: int


class _Staging:
    """A device buffer holding `batch` chunks of the model dtype plus one encoded payload."""

    def __init__(
        self,
        geometry: KVGeometry,
        chunk_tokens: int,
        batch: int,
        codec: Codec,
        device: torch.device,
    ) -> None:
        self.chunk_elems = geometry.chunk_bytes(chunk_tokens) // geometry.element_size
        self.chunks = torch.empty(
            batch * self.chunk_elems, dtype=geometry.torch_dtype(), device=device
        )
        self.payload = (
            None
            if codec.lossless
            else torch.empty(codec.payload_bytes(chunk_tokens), dtype=torch.uint8, device=device)
        )


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
        batch_chunks: int = 4,
    ) -> None:
        if chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
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
        self.arena = arena
        self.store = l3_store
        self.codec = codec
        self.batch_chunks = max(1, int(batch_chunks))
        self.cuda = self.device.type == "cuda"
        self._shape = geometry.chunk_shape(self.chunk_tokens)
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self._ops = dict.fromkeys(DIRECTIONS, 0)
        self._timed: deque[tuple[tuple[str, str], torch.cuda.Event, torch.cuda.Event]] = deque()
        self._slot_copy: dict[int, Handle] = {}  # slot -> last device copy touching it
        self._slot_io: dict[int, Future[Any]] = {}  # slot -> last L3 read or write of it
        self._writes_queued = 0
        self._writes: set[Future[Any]] = set()
        self._reads_queued = 0
        self._shed = 0
        self._write_errors = 0
        self._read_errors = 0
        self._closed = False
        self._down = self._up = None
        if self.cuda:
            self._down = torch.cuda.Stream(self.device)
            self._up = torch.cuda.Stream(self.device)
        self._stage_down = _Staging(geometry, chunk_tokens, self.batch_chunks, codec, self.device)
        self._stage_up = _Staging(geometry, chunk_tokens, 1, codec, self.device)
        self._writer = ThreadPoolExecutor(max(1, l3_threads), thread_name_prefix="kvtier-l3w")
        self._reader = ThreadPoolExecutor(max(1, l3_threads), thread_name_prefix="kvtier-l3r")
        self.l3_write_queue = int(l3_write_queue)

    # ---- L1 <-> L2 ---------------------------------------------------------------------------

    def offload(self, layers: Layers, start: int, ntokens: int, slot: int) -> Handle:
        """Copy tokens [start, start+ntokens) of every layer into L2 `slot` (one chunk)."""
        return self.offload_range(layers, start, ntokens, [slot])

    def offload_range(
        self, layers: Layers, start: int, ntokens: int, slots: Sequence[int]
    ) -> Handle:
        """Copy tokens [start, start+ntokens) into consecutive chunks, one per slot.

        Every chunk but the last is full; gathering several chunks at once takes one copy per
        layer and plane for the whole group, not per chunk.
        """
        self._check_range(layers, ntokens, slots)
        for slot in slots:
            self._settle_io(slot)
        t0 = time.perf_counter()
        moved = 0
        if self.cuda:
            stream = self._down
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                moved = self._offload_groups(layers, start, ntokens, slots)
                end.record(stream)
            for pair in layers:
                for t in pair:
                    t.record_stream(stream)
            handle = Handle(end, keep=(layers,))
            with self._lock:
                self._timed.append((("l1", "l2"), begin, end))
                self._bytes["l1", "l2"] += moved
                self._ops["l1", "l2"] += len(slots)
        else:
            moved = self._offload_groups(layers, start, ntokens, slots)
            handle = Handle()
            self._account(("l1", "l2"), moved, time.perf_counter() - t0, len(slots))
        for slot in slots:
            self._slot_copy[slot] = handle
        return handle

    def _offload_groups(
        self, layers: Layers, start: int, ntokens: int, slots: Sequence[int]
    ) -> int:
        n = self.chunk_tokens
        full = ntokens // n
        moved = 0
        direct = not self.cuda and self.codec.lossless
        index = 0
        while index < len(slots):
            count = min(self.batch_chunks, full - index) if index < full and not direct else 1
            length = count * n if index < full else ntokens - index * n
            first = start + index * n
            if direct and count == 1:
                # CPU + native: gather straight into the slot, no staging copy.
                dst = self._slot_chunk(slots[index], length)
                self._gather(layers, first, 1, length, dst.unsqueeze(0))
                moved += dst.numel() * self.geometry.element_size
                index += 1
                continue
            group = self._staged(self._stage_down, count, length // count)
            self._gather(layers, first, count, length // count, group)
            for c in range(count):
                slot_view = self.arena.view(slots[index + c])
                if not self.cuda:  # encode straight into the slot
                    moved += self.codec.encode(group[c], out=slot_view).numel()
                    continue
                payload = self.codec.encode(group[c], out=self._stage_down.payload)
                slot_view[: payload.numel()].copy_(payload, non_blocking=True)
                moved += payload.numel()
            index += count
        return moved

    def restore(self, slot: int, ntokens: int, layers: Layers, start: int) -> Handle:
        """Copy the chunk in L2 `slot` into tokens [start, start+ntokens) of every layer."""
        return self.restore_range([slot], ntokens, layers, start)

    def restore_range(
        self, slots: Sequence[int], ntokens: int, layers: Layers, start: int
    ) -> Handle:
        """Copy consecutive chunks (every one full but the last) back into the L1 layers."""
        self._check_range(layers, ntokens, slots)
        for slot in slots:
            self._settle_io(slot)
        t0 = time.perf_counter()
        if self.cuda:
            stream = self._up
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                moved = self._restore_chunks(slots, ntokens, layers, start)
                end.record(stream)
            for pair in layers:
                for t in pair:
                    t.record_stream(stream)
            handle = Handle(end, keep=(layers,))
            with self._lock:
                self._timed.append((("l2", "l1"), begin, end))
                self._bytes["l2", "l1"] += moved
                self._ops["l2", "l1"] += len(slots)
        else:
            moved = self._restore_chunks(slots, ntokens, layers, start)
            handle = Handle()
            self._account(("l2", "l1"), moved, time.perf_counter() - t0, len(slots))
        for slot in slots:
            self._slot_copy[slot] = handle
        return handle

    def _restore_chunks(
        self, slots: Sequence[int], ntokens: int, layers: Layers, start: int
    ) -> int:
        n = self.chunk_tokens
        moved = 0
        for i, slot in enumerate(slots):
            length = min(n, ntokens - i * n)
            size = self.codec.payload_bytes(length)
            src = self.arena.view(slot)[:size]
            if self.cuda:
                stage = self._stage_up.payload if self._stage_up.payload is not None else None
                if stage is None:
                    stage = self._stage_up.chunks[: size // self.geometry.element_size].view(
                        torch.uint8
                    )
                payload = stage[:size]
                payload.copy_(src, non_blocking=True)
            else:
                payload = src
            out = self._staged(self._stage_up, 1, length)[0]
            if self.codec.lossless:
                chunk = self.codec.decode(payload, length)  # a view: no copy
            else:
                chunk = self.codec.decode(payload, length, out=out)
            self._scatter(chunk, layers, start + i * n, length)
            moved += size
        return moved

    # ---- gather / scatter --------------------------------------------------------------------

    def _staged(self, stage: _Staging, count: int, length: int) -> torch.Tensor:
        shape = self.geometry.chunk_shape(length)
        elems = count * shape[0] * shape[1] * length * shape[3] * shape[4]
        return stage.chunks[:elems].view(count, *shape)

    def _slot_chunk(self, slot: int, length: int) -> torch.Tensor:
        shape = self.geometry.chunk_shape(length)
        nbytes = self.geometry.chunk_bytes(length)
        return self.arena.view(slot)[:nbytes].view(self.geometry.torch_dtype()).view(shape)

    def _gather(
        self, layers: Layers, first: int, count: int, length: int, out: torch.Tensor
    ) -> None:
        """out[c, l, p] = layers[l][p][0, :, first + c*length : ...] as [token, head, dim]."""
        span = count * length
        for index, pair in enumerate(layers):
            for plane in range(self.geometry.kv_planes):
                src = pair[plane][0, :, first : first + span]  # [H, span, D]
                src = src.unflatten(1, (count, length)).permute(1, 2, 0, 3)
                out[:, index, plane].copy_(src)

    def _scatter(self, chunk: torch.Tensor, layers: Layers, first: int, length: int) -> None:
        for index, pair in enumerate(layers):
            for plane in range(self.geometry.kv_planes):
                pair[plane][0, :, first : first + length].copy_(chunk[index, plane].transpose(0, 1))

    def _check_range(self, layers: Layers, ntokens: int, slots: Sequence[int]) -> None:
        if self._closed:
            raise ConfigError("the transfer engine is closed")
        if len(layers) != self.geometry.num_layers:
            raise ConfigError(
                f"got {len(layers)} layers but the geometry has {self.geometry.num_layers}"
            )
        n = self.chunk_tokens
        if ntokens <= 0 or not slots or -(-ntokens // n) != len(slots):
            raise ConfigError(
                f"{ntokens} tokens need {-(-ntokens // n)} slots of {n} tokens, got {len(slots)}"
            )

    # ---- L2 <-> L3 ---------------------------------------------------------------------------

    def write_l3(self, slot: int, header: Any) -> Future[Any] | None:
        """Queue the chunk in `slot` for a durable L3 write; None when shed (queue full)."""
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to write to SSD")
        with self._lock:
            if self._writes_queued >= self.l3_write_queue:
                self._shed += 1
                return None
            self._writes_queued += 1
        copy = self._slot_copy.get(slot)
        try:
            future = self._writer.submit(self._write, slot, header, copy)
        except BaseException:
            with self._lock:
                self._writes_queued -= 1
            raise
        self._slot_io[slot] = future
        with self._lock:
            self._writes.add(future)
        future.add_done_callback(self._write_done)
        return future

    def _write_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._writes.discard(future)

    def _write(self, slot: int, header: Any, copy: Handle | None) -> Any:
        try:
            if copy is not None:
                copy.wait()  # the chunk must have landed in the slot before it is written
            t0 = time.perf_counter()
            payload = self.arena.buffer(slot)[: header.payload_len]
            written = self._need_store().put(header, payload)
            self._account(("l2", "l3"), header.payload_len, time.perf_counter() - t0, 1)
            return written
        except BaseException:
            with self._lock:
                self._write_errors += 1
            raise
        finally:
            with self._lock:
                self._writes_queued -= 1

    def read_l3(self, key: bytes, slot: int, fingerprint: bytes) -> Future[Any]:
        """Read chunk `key` from L3 into `slot` (O_DIRECT); the future yields its ChunkHeader.

        A checksum, fingerprint or I/O failure comes back as the future's exception: the caller
        treats it as a miss and recomputes; no byte of it reaches the GPU.
        """
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to read from SSD")
        self._settle_io(slot)
        copy = self._slot_copy.get(slot)
        with self._lock:
            self._reads_queued += 1
        future = self._reader.submit(self._read, key, slot, fingerprint, copy)
        self._slot_io[slot] = future
        return future

    def _read(self, key: bytes, slot: int, fingerprint: bytes, copy: Handle | None) -> Any:
        try:
            if copy is not None:
                copy.wait()  # a copy still reading the slot must finish before it is overwritten
            t0 = time.perf_counter()
            header = self._need_store().get(key, self.arena.buffer(slot), fingerprint=fingerprint)
            self._account(("l3", "l2"), header.payload_len, time.perf_counter() - t0, 1)
            return header
        except BaseException:
            with self._lock:
                self._read_errors += 1
            raise
        finally:
            with self._lock:
                self._reads_queued -= 1

    def _need_store(self) -> Any:
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to use the SSD tier")
        return self.store

    def _settle_io(self, slot: int) -> None:
        """Wait for L3 I/O on `slot` before a device copy touches it (errors stay with it)."""
        future = self._slot_io.pop(slot, None)
        if future is not None:
            future.exception()

    def busy(self, slot: int) -> bool:
        """Whether a copy or L3 I/O on `slot` may still be running (do not free it yet)."""
        copy = self._slot_copy.get(slot)
        io = self._slot_io.get(slot)
        return (copy is not None and not copy.done()) or (io is not None and not io.done())

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
                l3_write_queue=self._writes_queued,
                l3_read_queue=self._reads_queued,
                shed_writes=self._shed,
                l3_write_errors=self._write_errors,
                l3_read_errors=self._read_errors,
            )

    def synchronize(self) -> None:
        """Wait for every device copy issued so far."""
        for stream in (self._down, self._up):
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
        self._slot_copy.clear()
        self._slot_io.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
