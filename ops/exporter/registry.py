"""The host collector and `make_registry()`, the registry `kvtier serve` mounts at /metrics.

`HostCollector` samples the host on every scrape. Its only state is the previous
`HostSnapshot`, passed explicitly to `ops.collectors.sample(previous=...)` so that the iostat
rates and the page-cache hit ratio cover the time since the last scrape; every metric family is
built fresh. With two Prometheus servers scraping, those two ratios cover the time since either
one's last scrape (the counters they are computed from are exported too).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client import ProcessCollector as _ClientProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ops.collectors import HostSnapshot, sample
from ops.collectors.proc import page_size
from ops.exporter.cache import CacheCollector, SnapshotFn
from ops.exporter.host import snapshot_families

SampleFn = Callable[[HostSnapshot | None], HostSnapshot]


class HostCollector(Collector):
    """Host signals (memory, PSI, fragmentation, page cache, L3 drive, GPUs) per scrape."""

    def __init__(
        self,
        l3_root: str | os.PathLike[str] | None = None,
        *,
        sample_fn: SampleFn | None = None,
        nvml: bool = True,
    ) -> None:
        self._l3_root = None if l3_root is None else os.fspath(l3_root)
        root = self._l3_root
        self._sample = sample_fn or (lambda previous: sample(root, previous=previous, nvml=nvml))
        self._previous: HostSnapshot | None = None
        self._lock = threading.Lock()  # concurrent scrapes must not interleave previous/next
        self._page_size = page_size()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            host = self._sample(self._previous)
            self._previous = host
        yield from snapshot_families(host, self._page_size, self._filesystem())

    def describe(self) -> Iterator[Metric]:
        return iter(())  # sampling at registration would read every source for nothing

    def _filesystem(self) -> tuple[int, int] | None:
        if self._l3_root is None:
            return None
        try:
            st = os.statvfs(self._l3_root)
        except OSError:
            return None
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


class ServingProcessCollector(Collector):
    """What prometheus_client's process collector (`process_*`: RSS, CPU seconds, fds) lacks
    for a serving process: its threads, its child processes (the L3 writer) and their memory,
    and the files under the L3 root that it and its children hold open. Read with psutil on
    every scrape; a child that exits mid-scrape is skipped."""

    def __init__(self, l3_root: str | os.PathLike[str] | None = None, pid: int | None = None):
        self._process = psutil.Process(pid)
        self._l3_root = None if l3_root is None else os.path.realpath(os.fspath(l3_root))

    def collect(self) -> Iterator[Metric]:
        me = self._process
        children = me.children(recursive=True)
        rss, open_files = 0, 0
        for proc in (me, *children):
            try:
                if proc is not me:
                    rss += proc.memory_info().rss
                if self._l3_root is not None:
                    open_files += sum(1 for f in proc.open_files() if self._under_root(f.path))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        yield GaugeMetricFamily(
            "kvtier_process_threads", "Threads of the serving process.", value=me.num_threads()
        )
        yield GaugeMetricFamily(
            "kvtier_process_children",
            "Child processes of the serving process (the L3 writer process, when it runs one).",
            value=len(children),
        )
        yield GaugeMetricFamily(
            "kvtier_process_children_resident_memory_bytes",
            "Resident memory of the serving process's children (its own: process_resident_"
            "memory_bytes).",
            value=rss,
        )
        if self._l3_root is not None:
            yield GaugeMetricFamily(
                "kvtier_process_l3_open_files",
                "Files under the L3 root held open by the serving process and its children.",
                value=open_files,
            )

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def _under_root(self, path: str) -> bool:
        root = self._l3_root
        return root is not None and (path == root or path.startswith(root + os.sep))


def register_process(
    registry: CollectorRegistry, l3_root: str | os.PathLike[str] | None = None
) -> None:
    """The serving process's own signals on `registry`: prometheus_client's `process_*`
    (Linux: RSS, virtual memory, CPU seconds, open and max fds, start time) and
    `ServingProcessCollector`'s `kvtier_process_*`."""
    _ClientProcessCollector(registry=registry)
    registry.register(ServingProcessCollector(l3_root))


def make_registry(
    snapshot_fn: SnapshotFn | None = None,
    l3_root: str | os.PathLike[str] | None = None,
    *,
    host: bool = True,
    nvml: bool = True,
) -> CollectorRegistry:
    """A fresh registry with the cache collector (when `snapshot_fn` is given) and the host
    collector (unless `host=False`); `l3_root` adds the L3 drive, page cache and filesystem."""
    registry = CollectorRegistry(auto_describe=False)
    if snapshot_fn is not None:
        registry.register(CacheCollector(snapshot_fn))
    if host:
        registry.register(HostCollector(l3_root, nvml=nvml))
    return registry
