"""Prometheus exporter: `CacheSnapshot` + `HostSnapshot` -> metric families (docs/metrics.md).

`make_registry()` builds the registry `kvtier serve` mounts at /metrics; `kvtier exporter`
serves one on its own for hosts whose cache runs in another process (ops.exporter.standalone).
"""

from __future__ import annotations

from ops.exporter.cache import CacheCollector
from ops.exporter.registry import HostCollector, make_registry

__all__ = ["CacheCollector", "HostCollector", "make_registry"]
