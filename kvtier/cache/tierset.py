"""The tiers a cache opens at start: L1 on the model's device, the L3 store, the L2 arena and
the transfer engine between them (with the L3 writer process where it can run). Each is closed
again through `undo` if a later step of the cache's start fails.

`L2Tier` and `L3Tier` are L2 and L3 as the cache's cold tiers (`kvtier.cache.coldtier`): what
the chunk directory knows of them, and their reads and writes through the transfer engine."""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.config import CacheConfig
from kvtier.cache.stats import Counters
from kvtier.errors import BudgetError, ConfigError
from kvtier.geometry import KVGeometry
from kvtier.sealing import load_master_key
from kvtier.tiers.l1 import L1Pool
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3 import L3Store
from kvtier.transfer import TransferEngine
from kvtier.types import Tier

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.costmodel import CostModel
    from kvtier.cache.directory import Chunk, ChunkDirectory
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.restoreplan import TierReads

log = logging.getLogger("kvtier")


def open_tiers(
    config: CacheConfig,
    geometry: KVGeometry,
    codec: Any,
    device: torch.device,
    counters: Counters,
    undo: contextlib.ExitStack,
) -> tuple[L1Pool, L3Store, HostArena, TransferEngine]:
    """L1, L3, L2 and the transfer engine, L1 claimed (`claim_l1`); the engine's backpressure
    waits are counted in `counters`."""
    master = None
    if config.encrypt and config.master_key_file is not None:
        master = load_master_key(config.master_key_file)
    l1 = L1Pool(geometry, config.l1_bytes or default_l1_bytes(device), device, config.chunk_tokens)
    l3 = L3Store(
        config.l3_root,
        keep_page_cache=config.keep_page_cache,
        max_bytes=config.l3_max_bytes,
        cold_dir=config.l3_cold_root,
        master_key=master,
        need_key=True,
    )
    undo.callback(l3.close)
    slot_bytes = codec.payload_bytes(config.chunk_tokens)
    writer = config.l3_writer
    if writer == "auto":
        writer = "process" if device.type == "cuda" else "threads"
    want_process = writer == "process" and hasattr(os, "memfd_create")
    parts = (config, geometry, codec, device, l3, slot_bytes)
    try:
        l2, engine = _open_l2(*parts, want_process, undo)
    except (BudgetError, OSError) as exc:
        if not want_process:
            raise
        # Shared memory or the child could not be had here: the same cache with writer
        # threads (write-through then competes with decode for this interpreter).
        log.warning("L3 writer process unavailable (%s); writing L3 from threads", exc)
        l2, engine = _open_l2(*parts, False, undo)
    engine.inflight.on_wait = counters.count_wait
    claim_l1(l1, engine)
    return l1, l3, l2, engine


def _open_l2(
    config: CacheConfig,
    geometry: KVGeometry,
    codec: Any,
    device: torch.device,
    l3: L3Store,
    slot_bytes: int,
    writer_process: bool,
    undo: contextlib.ExitStack,
) -> tuple[HostArena, TransferEngine]:
    arena = HostArena(slot_bytes, config.l2_bytes, pin=config.pin_memory, shared=writer_process)
    try:
        engine = TransferEngine(
            geometry,
            config.chunk_tokens,
            device,
            arena,
            l3,
            codec,
            l3_write_queue=config.l3_write_queue,
            l3_threads=config.l3_threads,
            writer_process=writer_process,
            inflight_bytes_max=config.inflight_bytes_max,
        )
    except BaseException:
        arena.close()
        raise
    undo.callback(arena.close)
    undo.callback(engine.close)  # runs first: the engine uses the arena
    chunk = geometry.chunk_bytes(config.chunk_tokens)
    if engine.inflight.max_bytes < chunk:
        raise ConfigError(
            f"inflight_bytes_max ({engine.inflight.max_bytes}) must hold at least one chunk "
            f"of {chunk} bytes (a chunk gathered from pages is in flight until copied)"
        )
    return arena, engine


def claim_l1(l1: L1Pool, engine: TransferEngine) -> None:
    """On a GPU, l1_bytes is kvtier's device memory but for copies in flight (bounded apart,
    `TieredCache.device_bytes`): the engine's staging buffers come out of it, and the rest is
    claimed for L1 now (`L1Pool.reserve`)."""
    if l1.device.type != "cuda":
        return
    staging = engine.staging_bytes
    if staging >= l1.budget_bytes:
        raise ConfigError(
            f"l1_bytes ({l1.budget_bytes}) must exceed the transfer engine's staging "
            f"buffers ({staging} bytes); raise l1_bytes"
        )
    l1.budget_bytes -= staging
    l1.reserve()


def default_l1_bytes(device: torch.device) -> int:
    """Half the free memory of a GPU; 1 GiB on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    return 1 << 30


class L2Tier:
    """L2, the pinned host arena, as a cold tier: the chunk directory's slots. Every read from a
    tier below lands in an L2 slot, so a chunk L2 holds is either ready in its slot (the restore
    copies it as it is) or on its way there (the restore waits for that read)."""

    tier = Tier.L2.value

    def __init__(self, directory: ChunkDirectory, cost: CostModel) -> None:
        self.directory = directory
        self.cost = cost

    def holds(self, key: bytes) -> int | None:
        e = self.directory.get(key)
        return e.tokens if e is not None and e.l2_slot is not None else None

    def start_read(self, e: Chunk, reads: TierReads) -> Future[Any] | None:
        """The read filling the chunk's slot (a prefetch's, or another restore's): L2 starts
        none of its own. Only asked for a chunk whose slot is not ready."""
        assert e.l3_read is not None, "a chunk ready in its L2 slot needs no read"
        return e.l3_read

    def launch(self, reads: TierReads, tenant: str) -> None:
        """Nothing to start: `start_read` only joins reads in flight."""

    def write(self, e: Chunk) -> None:
        """The slot is L2's copy: the eviction policy sees the chunk as just used."""
        self.directory.touch(e.key)

    def observe(self, reads: TierReads, nbytes: int, t_read: float, t_copy: float) -> None:
        """Chunks found ready in L2 cost only their copy to L1 (a staged restore copies later:
        no time, no sample)."""
        self.cost.observe_load(self.tier, nbytes, t_copy)


class L3Tier:
    """L3, the SSD store, as a cold tier: the chunk directory's map of the keys L3 holds, reads
    through the transfer engine's L3 readers and writes queued behind each stored chunk."""

    tier = Tier.L3.value

    def __init__(
        self,
        directory: ChunkDirectory,
        engine: TransferEngine,
        identity: CacheIdentity,
        cost: CostModel,
    ) -> None:
        self.directory = directory
        self.engine = engine
        self.identity = identity
        self.cost = cost

    def holds(self, key: bytes) -> int | None:
        return self.directory.l3_tokens.get(key)

    def start_read(self, e: Chunk, reads: TierReads) -> Future[Any] | None:
        """Reserve an L2 slot for `e` and read it from L3 (or join the read in flight). The
        file's header must describe `e` (its tokens, the cache's geometry and codec, its
        tenant when known): anything else is corrupt, never the slot's bytes."""
        expect = self.identity.header(e)
        fp = self.identity.fingerprint
        return self.directory.start_fetch(
            e, lambda slot: self.engine.read_l3(e.key, slot, fp, expect), self
        )

    def launch(self, reads: TierReads, tenant: str) -> None:
        """Nothing to start: each read is queued as `start_read` asks for it."""

    def write(self, e: Chunk) -> None:
        """Queue the L2 -> L3 write (shed when the queue is full; the directory retries)."""
        self.directory.queue_write(e)

    def observe(self, reads: TierReads, nbytes: int, t_read: float, t_copy: float) -> None:
        """L3's bandwidth as a restore sees it: the wait for the reads and the throttle, and
        the bytes' share of the copy to L1. A failed read is forgotten (`settle_read`)."""
        self.cost.observe_load(self.tier, nbytes, t_read + t_copy)
