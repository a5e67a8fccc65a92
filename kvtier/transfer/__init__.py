"""The transfer engine: the one owner of every copy between the tiers.

See docs/architecture.md, "Movement and policy".

`TransferEngine` composes two movers that share only the per-slot ordering and the totals:

- `kvtier.transfer.device.DeviceMover`: L1 <-> L2, CUDA streams, staging buffers and events
  (`kvtier.transfer.staging`: `Handle`, the staging buffers; `kvtier.transfer.layout`: the
  L1 views a copy moves and the checks of a range);
- `kvtier.transfer.disk.DiskMover`: L2 <-> L3, the thread pools, the writer child process
  (kvtier.tiers.l3.writer), the bounded write queue and its shedding;
- `kvtier.transfer.accounting`: bytes, seconds and copies per direction, `EngineStats`;
- `kvtier.transfer.slots`: the per-slot order of the two movers' work (`SlotOrder`);
- `kvtier.transfer.inflight`: the device bytes copies in flight hold outside the L1 pool's
  budget (released L1 blocks still going down, chunks gathered from pages), under one bound
  (`inflight`, `inflight_bytes_max`): past it, the caller waits for copies to finish.

A device copy on a slot first settles the disk's I/O on it (a restore waits for the slot's
L3 read just before that chunk's copy, and a failed read raises there); an L3 job first
waits for the device copy still using its slot. Each mover finds the other's work in the
`SlotOrder` they share, and neither calls the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.codecs import Codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3.writer import WriterProcess
from kvtier.transfer.accounting import DIRECTIONS, Accounts, EngineStats
from kvtier.transfer.device import GROUP_BYTES, MAX_GROUP, DeviceMover
from kvtier.transfer.disk import DiskMover
from kvtier.transfer.gatherbufs import GatherBuffers
from kvtier.transfer.inflight import Inflight, Ticket
from kvtier.transfer.layout import Layers
from kvtier.transfer.slots import SlotOrder
from kvtier.transfer.staging import Handle

__all__ = [
    "DIRECTIONS",
    "GROUP_BYTES",
    "INFLIGHT_STAGINGS",
    "MAX_GROUP",
    "EngineStats",
    "Handle",
    "Inflight",
    "Layers",
    "Ticket",
    "TransferEngine",
    "WriterProcess",
]

# The default bound of copies in flight (`inflight_bytes_max`), in staging buffers' worth: as
# much again as the staging (what kvtier.server.devices.memplan sets aside for them).
INFLIGHT_STAGINGS = 1
_STAGES = 4  # staging buffers of a GPU engine: two per direction


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
        inflight_bytes_max: int | None = None,
    ) -> None:
        self._accounts = Accounts()
        self._slots = SlotOrder()
        self._closed = False
        self._device = DeviceMover(
            geometry,
            chunk_tokens,
            device,
            arena,
            codec,
            self._accounts,
            self._slots,
            group_chunks=group_chunks,
        )
        self.geometry = geometry
        self.chunk_tokens = self._device.chunk_tokens
        self.device = self._device.device
        self.arena = arena
        self.store = l3_store
        self.codec = codec
        self.group_chunks = self._device.group_chunks
        self.cuda = self._device.cuda
        self.l3_write_queue = int(l3_write_queue)
        proc: WriterProcess | None = None
        if writer_process and l3_store is not None:
            if not arena.shared:
                raise ConfigError("writer_process needs an L2 arena built with shared=True")
            proc = WriterProcess(arena.slabs(), threads=l3_threads)
        self._disk = DiskMover(
            arena,
            l3_store,
            self._accounts,
            self._slots,
            l3_write_queue=l3_write_queue,
            l3_threads=l3_threads,
            proc=proc,
        )
        if inflight_bytes_max is None:
            inflight_bytes_max = self.default_inflight_bytes()
        # Device bytes copies in flight hold outside the L1 pool's budget, and their bound.
        self.inflight = Inflight(inflight_bytes_max)
        self._gather: GatherBuffers | None = None  # made at the first gather from pages

    def default_inflight_bytes(self) -> int:
        """The default `inflight_bytes_max`: `INFLIGHT_STAGINGS` times the staging buffers (on
        a CPU, or with the native codec's none there, the four buffers a GPU engine holds)."""
        gpu = _STAGES * self.group_chunks * self.geometry.chunk_bytes(self.chunk_tokens)
        return INFLIGHT_STAGINGS * max(self.staging_bytes, gpu)

    def inflight_bytes(self) -> int:
        """Device bytes that copies in flight hold now outside the L1 pool's budget (at most
        `inflight.max_bytes`; see kvtier.transfer.inflight)."""
        return self.inflight.bytes()

    def move_device(self, device: torch.device, *, lost: bool) -> tuple[int, set[int]]:
        """Move the device side (streams, staging buffers) to `device`, after the old device
        was lost (`lost`) or before it is given up. Returns the old device's staging bytes (0
        off a GPU) and the L2 slots whose last copy down from a lost device did not complete
        (their bytes may be partial; empty when not `lost`). The copies in flight of a lost
        device held its memory: their accounting is dropped."""
        old = self._device
        if not lost:
            old.synchronize()  # the copies down have left the old device
        staging = old.staging_bytes if old.cuda else 0
        suspect = old.unfinished_copies() if lost else set()
        if lost:
            self.inflight.clear()
        self._gather = None  # the old device's buffers go with it
        mover = DeviceMover(
            old.geometry,
            old.chunk_tokens,
            device,
            old.arena,
            old.codec,
            self._accounts,
            self._slots,
            group_chunks=old.group_chunks,
        )
        old.abandon()
        self._slots.take_copies()  # the old device's copies: L3 jobs wait for none of them
        self._device = mover
        self.device = mover.device
        self.cuda = mover.cuda
        return staging, suspect

    @property
    def _proc(self) -> WriterProcess | None:
        """The writer child, when L3 file writes run in one."""
        return self._disk.proc

    @property
    def l3_writer(self) -> str:
        """Where this engine's L3 file writes run: "process" or "threads"."""
        return "threads" if self._proc is None else "process"

    @property
    def staging_bytes(self) -> int:
        """Device (or host, on CPU) memory the staging buffers hold, for the L1 budget."""
        return self._device.staging_bytes

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
        return self._device.offload(layers, start, ntokens, slot, block=block)

    def offload_range(
        self,
        layers: Layers,
        start: int,
        ntokens: int,
        slots: Sequence[int],
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy tokens [start, start+ntokens) into consecutive chunks, one per slot
        (`DeviceMover.offload_range`)."""
        return self._device.offload_range(layers, start, ntokens, slots, block=block)

    def gather_buffer(self, ntokens: int) -> tuple[Ticket, torch.Tensor]:
        """Room for one chunk gathered from a batch's pages, and the device buffer, in the chunk
        layout of `ntokens` tokens, that it is gathered into (`GatherBuffers`, reused once the
        chunk's copy is done: no device memory is allocated for it). The room is a full chunk's
        in `inflight`, taken first: at the bound a burst of commits waits here for older
        copies. Both go to `offload_chunk` (`ticket=`), or the ticket to `give_back` where the
        gather failed."""
        per_chunk = self.geometry.chunk_bytes(self.chunk_tokens)
        ticket = self.inflight.take(per_chunk)
        if ticket is None:  # refused at start (kvtier.cache.tierset): never here
            raise RuntimeError("the bound of copies in flight is smaller than one chunk")
        try:
            bufs = self._gather
            if bufs is None or bufs.device != self.device:
                bufs = self._gather = GatherBuffers(
                    self.inflight,
                    self.device,
                    self.geometry.torch_dtype(),
                    per_chunk // self.geometry.element_size,
                )
            return ticket, bufs.take(ticket, self.geometry.chunk_shape(ntokens))
        except BaseException:
            self.inflight.give_back(ticket)
            raise

    def give_back(self, ticket: Ticket) -> None:
        """Return the room of a gather whose chunk is not copied (`gather_buffer`)."""
        self.inflight.give_back(ticket)

    def gather_bytes(self) -> int:
        """Device bytes the gather buffers hold (at most `inflight.max_bytes`)."""
        return 0 if self._gather is None else self._gather.nbytes

    def offload_chunk(
        self, chunk: torch.Tensor, slot: int, *, ticket: Ticket | None = None
    ) -> Handle:
        """Copy a chunk already in the chunk layout on the device into L2 `slot`
        (`DeviceMover.offload_chunk`: pages gathered by a batch, native codec).

        The chunk counts as in flight until its copy is done. `ticket`: the room the caller
        took in `inflight` before gathering the chunk (`gather_buffer`); without one it is
        taken now, which at the bound waits for older copies (the chunk exists already: gather
        after taking room to stay under the bound)."""
        nbytes = chunk.numel() * chunk.element_size()
        if ticket is None:
            ticket = self.inflight.take(nbytes)
        try:
            handle = self._device.offload_chunk(chunk, slot)
        except BaseException:
            self.inflight.give_back(ticket)
            raise
        if ticket is None:  # larger than the bound on its own: never left in flight
            handle.wait()
        else:
            self.inflight.bind(ticket, handle)
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
        return self._device.restore(slot, ntokens, layers, start, block=block)

    def restore_range(
        self,
        slots: Sequence[int],
        ntokens: int,
        layers: Layers,
        start: int,
        *,
        block: torch.Tensor | None = None,
    ) -> Handle:
        """Copy consecutive chunks back into the L1 layers (`DeviceMover.restore_range`)."""
        return self._device.restore_range(slots, ntokens, layers, start, block=block)

    def restore_chunks(
        self, slots: Sequence[int], ntokens: int, write: Callable[[int, torch.Tensor], None]
    ) -> Handle:
        """Copy consecutive chunks out of L2 for `write` to land where it wants, a batch's page
        pool (`DeviceMover.restore_chunks`)."""
        return self._device.restore_chunks(slots, ntokens, write)

    # ---- L2 <-> L3 ---------------------------------------------------------------------------

    def write_l3(self, slot: int, header: Any) -> Future[Any] | None:
        """Queue the chunk in `slot` for a durable L3 write; None when shed (queue full)."""
        return self._disk.write_l3(slot, header)

    def read_l3(
        self, key: bytes, slot: int, fingerprint: bytes, expect: ChunkHeader | None = None
    ) -> Future[Any]:
        """Read chunk `key` from L3 into `slot` (O_DIRECT); the future yields its ChunkHeader.
        `expect`: the header of the chunk asked for, which the file's must match
        (`DiskMover.read_l3`)."""
        return self._disk.read_l3(key, slot, fingerprint, expect)

    def busy(self, slot: int) -> bool:
        """Whether a copy or L3 I/O on `slot` may still be running (do not free it yet)."""
        return self._slots.busy(slot)

    def forget(self, slot: int) -> None:
        """Wait for everything on `slot`, then drop its tracking (call before freeing it)."""
        self._slots.forget(slot)

    def flush(self) -> None:
        """Wait until every queued L3 write has finished (successfully or not)."""
        self._disk.flush()

    # ---- accounting, lifetime ----------------------------------------------------------------

    def stats(self) -> EngineStats:
        self._accounts.collect_timings()
        with self._accounts.lock:
            write_q, read_q, shed, write_errors, read_errors = self._disk.counts()
            return EngineStats(
                transfers=self._accounts.transfers(),
                l3_write_queue=write_q,
                l3_read_queue=read_q,
                shed_writes=shed,
                l3_write_errors=write_errors,
                l3_read_errors=read_errors,
                staging_bytes=self.staging_bytes,
            )

    def synchronize(self) -> None:
        """Wait for every device copy issued so far."""
        self._device.synchronize()

    def close(self) -> None:
        """Finish queued L3 writes (never drop stored data), then stop. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._device.close()
        self._disk.close()
        self._device.free()
        self._slots.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
