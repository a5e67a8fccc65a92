"""The standalone exporter: an L3 store's index, read-only, plus the host collectors.

For hosts whose cache runs in another process (or not at all right now): the store's sessions
and occupancy come from its SQLite index opened read-only, so the exporter never takes the
writer lock, never writes, and never competes with the serving process for anything but reads.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from kvtier.errors import ConfigError
from kvtier.snapshot import CacheSnapshot, TierStats
from kvtier.tiers.l3 import L3Store
from ops.exporter.cache import CacheCollector, SnapshotFn
from ops.exporter.registry import HostCollector

DEFAULT_LISTEN = "127.0.0.1:9481"


def l3_snapshot_fn(store: L3Store) -> SnapshotFn:
    """A snapshot function over a (read-only) store: the L3 tier and its sessions by state."""

    lock = threading.Lock()  # concurrent scrapes share one SQLite connection

    def snapshot() -> CacheSnapshot:
        with lock:
            s = store.stats()
            by_state = _sessions_by_state(store)
        tier = TierStats(
            "l3",
            capacity_bytes=s.capacity_bytes,
            used_bytes=s.used_bytes,
            chunks=s.chunks,
            hits=s.reads,
            misses=s.misses,
            evictions=s.evictions,
        )
        return CacheSnapshot(
            taken_at=time.time(),
            tiers=(tier,),
            sessions_by_state=tuple(sorted(by_state.items())),
            checksum_failures=s.checksum_failures,
            io_errors=s.io_errors,
        )

    return snapshot


def _sessions_by_state(store: L3Store) -> Counter[str]:
    """Sessions per state with one aggregate query (loading 1,000 records with their token ids
    would dominate the scrape); the full record list is the fallback if the schema changes."""
    try:
        rows = store.index.db.execute("SELECT state, count(*) FROM sessions GROUP BY state")
        return Counter({str(state): int(n) for state, n in rows})
    except sqlite3.Error:
        return Counter(record.state for record in store.list_sessions())


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`) -> (host, port), with a message that says what to write."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--listen {listen!r} is not HOST:PORT; write for example {DEFAULT_LISTEN}"
        )
    return host, int(port)


def open_store(l3_root: str | os.PathLike[str]) -> L3Store:
    """Open the store read-only, or explain why the directory is not one."""
    root = Path(l3_root)
    if not root.is_dir():
        raise ConfigError(f"--l3-root {root} is not a directory; point it at the store's root")
    return L3Store(root, read_only=True)


def build(
    l3_root: str | os.PathLike[str], *, nvml: bool = True
) -> tuple[CollectorRegistry, L3Store]:
    """The standalone registry (cache view of the store + host) and the store to close later."""
    store = open_store(l3_root)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(l3_snapshot_fn(store)))
    registry.register(HostCollector(l3_root, nvml=nvml))
    return registry, store


def serve(registry: CollectorRegistry, listen: str = DEFAULT_LISTEN) -> Any:
    """Serve /metrics on `listen` in a daemon thread; returns the HTTP server (shutdown())."""
    host, port = parse_listen(listen)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
