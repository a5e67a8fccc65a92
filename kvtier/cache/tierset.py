"""The tiers a cache opens at start: L1 on the model's device, the L3 store, the L2 arena and
the transfer engine between them (with the L3 writer process where it can run). Each is closed
again through `undo` if a later step of the cache's start fails."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

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
