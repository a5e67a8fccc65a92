"""The standalone exporter: an L3 store's index, read-only, plus the host collectors.

For hosts whose cache runs in another process (or not at all right now): the store's sessions
and occupancy come from its SQLite index opened read-only, so the exporter never takes the
writer lock, never writes, and never competes with the serving process for anything but reads.

It exports only what the index knows (`INDEX_METRICS`): the L3 tier's occupancy and the session
records. What lives only in the serving process (L1 and L2, transfers, queues, restore decisions
and latencies, error counters) has no series here rather than a zero that reads as "none
happened". A record says how a session was when it was last saved (the cache saves one when it
hibernates a session), so a session the server has since resumed still counts as hibernated
here: docs/metrics.md, "Server and standalone exporter".
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.errors import ConfigError, StoreError
from kvtier.snapshot import CacheSnapshot, TierStats
from kvtier.tiers.l3 import L3Store
from ops.exporter.cache import SnapshotFn, families, l3_up
from ops.exporter.registry import HostCollector

DEFAULT_LISTEN = "127.0.0.1:9481"
log = logging.getLogger("kvtier.exporter")

# The cache families the standalone exporter serves (exposition names): what the index knows.
INDEX_METRICS = (
    "kvtier_l3_up",
    "kvtier_tier_capacity_bytes",
    "kvtier_tier_used_bytes",
    "kvtier_tier_chunks",
    "kvtier_sessions",
    "kvtier_snapshot_timestamp_seconds",
)
# The states a record can hold, always present (0 when no record has it), as the server's are:
# a hibernated session's, and with paged L1 (serve's default) the record a turn's end saves,
# idle, its KV in the page pool and already in L2/L3; `pinned` counts records across states.
_RECORD_STATES = ("hibernated", "idle", "pinned")
SESSIONS_HELP = (
    "Sessions with a record in the L3 index: by the state recorded when last saved "
    "(hibernated; idle with paged L1), and pinned."
)


def l3_snapshot_fn(store: L3Store) -> SnapshotFn:
    """A snapshot function over a (read-only) store: the L3 tier's occupancy and its session
    records by state (plus `pinned`). The store's own counters are left out: opened read-only,
    they count this process's reads, not the server's."""

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
        )  # no hits, misses or evictions: a read-only store's counters count only our reads
        return CacheSnapshot(
            taken_at=time.time(),
            tiers=(tier,),
            sessions_by_state=tuple(sorted(by_state.items())),
        )

    return snapshot


def _sessions_by_state(store: L3Store) -> Counter[str]:
    """Records per recorded state, and `pinned`: the records whose pinned flag is set (the
    server counts pinned sessions the same way, across states). Aggregate queries (loading
    1,000 records with their token ids would dominate the scrape); the full record list is
    the fallback if the schema changes."""
    try:
        db = store.index.db
        rows = db.execute("SELECT state, count(*) FROM sessions GROUP BY state").fetchall()
        (pinned,) = db.execute("SELECT count(*) FROM sessions WHERE pinned != 0").fetchone()
        by_state = Counter({str(state): int(n) for state, n in rows})
    except sqlite3.Error:
        records = store.list_sessions()
        by_state = Counter(record.state for record in records)
        pinned = sum(1 for record in records if record.pinned)
    by_state["pinned"] = int(pinned)
    return by_state


def index_families(snap: CacheSnapshot) -> Iterator[Metric]:
    """The families of `INDEX_METRICS` for a snapshot of the index: the server's names and
    types, without the families only the serving process can fill, and `kvtier_sessions` with
    the recorded states only (no `active`: no record is saved while a turn runs)."""
    for family in families(snap):
        if family.name == "kvtier_sessions":
            sessions = GaugeMetricFamily("kvtier_sessions", SESSIONS_HELP, labels=["state"])
            given = dict(snap.sessions_by_state)
            for state in (*_RECORD_STATES, *sorted(set(given) - set(_RECORD_STATES))):
                sessions.add_metric([state], given.get(state, 0))
            yield sessions
        elif family.name in INDEX_METRICS:
            yield family


class IndexCollector(Collector):
    """`index_families` of a snapshot function over a store that is open now."""

    def __init__(self, snapshot_fn: SnapshotFn) -> None:
        self._snapshot_fn = snapshot_fn

    def collect(self) -> Iterator[Metric]:
        yield from index_families(self._snapshot_fn())

    def describe(self) -> Iterator[Metric]:
        return iter(())


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`) -> (host, port), with a message that says what to write."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--listen {listen!r} is not HOST:PORT; write for example {DEFAULT_LISTEN}"
        )
    return host, int(port)


class StoreWatch(Collector):
    """The store's metrics once it exists, and `kvtier_l3_up` (0 until then) on every scrape.

    An exporter is started before the cache (systemd ordering), so the directory may hold no
    store yet: each scrape tries to open it read-only until that works. A store that stops
    answering (its index replaced or removed) is closed and looked for again the same way.
    """

    def __init__(self, l3_root: str | os.PathLike[str]) -> None:
        self.root = Path(l3_root)
        if not self.root.is_dir():
            raise ConfigError(
                f"--l3-root {self.root} is not a directory; point it at the store's root"
            )
        self._lock = threading.Lock()
        self._store: L3Store | None = None
        self._snapshot: SnapshotFn | None = None
        self.why_down = "not opened yet"

    def _open(self) -> SnapshotFn | None:
        if self._snapshot is None:
            try:
                self._store = L3Store(self.root, read_only=True)
            except (StoreError, sqlite3.Error, OSError) as exc:
                self.why_down = str(exc)
                return None
            self._snapshot = l3_snapshot_fn(self._store)
            log.info("L3 store at %s is up", self.root)
        return self._snapshot

    def up(self) -> bool:
        """Whether the store is open (trying to open it now if it is not)."""
        with self._lock:
            return self._open() is not None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = self._open()
            snap = None
            if snapshot is not None:
                try:
                    snap = snapshot()
                except (StoreError, sqlite3.Error, OSError) as exc:
                    self.why_down = str(exc)
                    log.warning("L3 store at %s stopped answering: %s", self.root, exc)
                    self._close()
        if snap is None:
            yield l3_up(False)
        else:
            yield from index_families(snap)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def _close(self) -> None:
        store, self._store, self._snapshot = self._store, None, None
        if store is not None:
            store.close()

    def close(self) -> None:
        with self._lock:
            self._close()


def open_store(l3_root: str | os.PathLike[str]) -> L3Store:
    """Open the store read-only, or explain why the directory is not one."""
    root = Path(l3_root)
    if not root.is_dir():
        raise ConfigError(f"--l3-root {root} is not a directory; point it at the store's root")
    return L3Store(root, read_only=True)


def build(
    l3_root: str | os.PathLike[str], *, nvml: bool = True
) -> tuple[CollectorRegistry, L3Store]:
    """A registry over a store that exists now (kvtop's one-shot view) and the store to close."""
    store = open_store(l3_root)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IndexCollector(l3_snapshot_fn(store)))
    registry.register(HostCollector(l3_root, nvml=nvml))
    return registry, store


def build_exporter(
    l3_root: str | os.PathLike[str], *, nvml: bool = True
) -> tuple[CollectorRegistry, StoreWatch]:
    """The standalone exporter's registry (cache view of the store + host) and the watch to
    close later. The directory must exist; the store in it may appear later (`kvtier_l3_up`)."""
    watch = StoreWatch(l3_root)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(watch)
    registry.register(HostCollector(l3_root, nvml=nvml))
    return registry, watch


def serve(registry: CollectorRegistry, listen: str = DEFAULT_LISTEN) -> Any:
    """Serve /metrics on `listen` in a daemon thread; returns the HTTP server (shutdown())."""
    host, port = parse_listen(listen)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
