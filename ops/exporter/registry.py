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

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
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
