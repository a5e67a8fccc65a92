"""Inputs for the exporter tests (no tests here): a cache snapshot with every field set, and a
host snapshot read by the real collectors from the captured H200 fixture tree (plus the sources
a capture cannot hold: page-cache residency, the CUDA allocator, an L3 drive's PCIe placement)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.snapshot import (
    RESTORE_BUCKETS,
    CacheSnapshot,
    RestoreHistogram,
    TierStats,
    TransferStats,
)
from ops.collectors import HostSnapshot, sample
from ops.collectors.disk import BlockDevice, DiskReading
from ops.collectors.pagecache import PageCacheReading, Residency
from ops.collectors.pcie import Link, TopologyFinding
from ops.collectors.torch_alloc import TorchAllocState
from ops.exporter import CacheCollector, HostCollector
from ops.exporter.registry import ServingProcessCollector
from ops.parsers import diskstats, nvml

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-h200"
GIB = 1 << 30


# The L4 stats the cache reports with an L4 (Redis) configured: `TieredCache.stats()["l4"]`;
# a Redis Cluster here, so the per-shard families are exported too (one server: `shards` []).
L4_STATS: dict[str, Any] = {
    "up": True,
    "breaker": "closed",
    "bytes_written": 14 << 20,
    "bytes_read": 7 << 20,
    "hits": 30,
    "misses": 4,
    "errors": 2,
    "writes_shed": 5,
    "get_seconds_sum": 0.75,
    "get_count": 34,
    "put_seconds_sum": 1.5,
    "put_count": 20,
    "url": "redis+cluster://127.0.0.1:7000",
    "shards": [
        {"shard": "127.0.0.1:7000", "slots": "0-8191", "replicas": 1, "hits": 20, "misses": 1},
        {"shard": "127.0.0.1:7001", "slots": "8192-16383", "replicas": 0, "hits": 10, "misses": 3},
    ],
}


@dataclass(frozen=True)
class SnapshotWithL4(CacheSnapshot):
    """A cache snapshot that carries L4 stats, as the cache's does with an L4 configured."""

    l4: Any = None


def without_l4(snap: CacheSnapshot) -> CacheSnapshot:
    """The same snapshot as a cache without an L4 reports it."""
    fields = {f: getattr(snap, f) for f in CacheSnapshot.__dataclass_fields__ if f != "l4"}
    return CacheSnapshot(**fields)


def full_cache_snapshot(taken_at: float = 1_700_000_000.0) -> CacheSnapshot:
    """Every field set, an L4 included."""
    n = len(RESTORE_BUCKETS)
    return SnapshotWithL4(
        taken_at=taken_at,
        tiers=(
            TierStats("l1", 8 * GIB, 6 * GIB, 400, hits=50, misses=7, evictions=3),
            TierStats("l2", 32 * GIB, 31 * GIB, 2000, hits=900, misses=70, evictions=120),
            TierStats("l3", 1024 * GIB, 200 * GIB, 14000, hits=300, misses=5, evictions=0),
        ),
        sessions_by_state=(("active", 4), ("idle", 10), ("hibernated", 986)),
        transfers=(
            TransferStats("l1", "l2", bytes=5 * GIB, seconds=0.25, ops=320),
            TransferStats("l2", "l1", bytes=3 * GIB, seconds=0.125, ops=200),
            TransferStats("l2", "l3", bytes=4 * GIB, seconds=2.0, ops=260),
            TransferStats("l3", "l2", bytes=GIB, seconds=0.5, ops=64),
        ),
        queue_depths=(("l2_write", 3), ("l3_write", 17)),
        restore_decisions=(("l1", 40), ("l2", 30), ("l3", 8), ("recompute", 2)),
        restored_tokens=(("l1", 40000), ("l2", 30000), ("l3", 8000)),
        restore_latency=(
            RestoreHistogram("l2", tuple([0] * 4 + [10] * (n - 4)), 30, 0.42),
            RestoreHistogram("l3", tuple([0] * 7 + [8] * (n - 7)), 8, 1.6),
        ),
        checksum_failures=1,
        shed_writes=12,
        io_errors=2,
        oom_retries=5,
        l4=L4_STATS,
    )


def fixture_host_snapshot() -> HostSnapshot:
    """The H200 capture through the real readers and parsers, plus hand-built readings of the
    sources that only exist live (each a real dataclass value, nothing patched)."""
    host = sample(None, proc_root=str(FIXTURE / "proc"), sys_root=str(FIXTURE / "sys"), nvml=False)
    stat = diskstats.parse((FIXTURE / "proc" / "diskstats").read_text())["vda"]
    drive = BlockDevice("vda", stat.major, stat.minor, "/sys/devices/virtual/vda", rotational=None)
    gpus = nvml.parse((FIXTURE / "nvml.json").read_text())
    link = Link("32.0 GT/s PCIe", 16, "32.0 GT/s PCIe", 16)
    return replace(
        host,
        disk=DiskReading(device=drive, stat=stat),
        gpus=gpus,
        pagecache=PageCacheReading(
            files=64,
            bytes=64 * 8192,
            residency=Residency(pages=128, cached=96),
            method="mincore",
            sampled=True,
            hit_ratio=0.5,
        ),
        topology=[
            TopologyFinding(
                gpu="0000:00:06.0",
                drive="0000:00:05.0",
                device="vda",
                level="host_bridge",
                common="pci0000:00",
                gpu_path="/sys/devices/pci0000:00/0000:00:06.0",
                drive_path="/sys/devices/pci0000:00/0000:00:05.0",
                gpu_link=link,
                drive_link=link,
                message="",
            )
        ],
        torch_alloc=[TorchAllocState(0, 6 * GIB, 5 * GIB, 256 << 20, 1, 0, 512 << 20)],
    )


def full_registry(l3_root: Path) -> CollectorRegistry:
    """Every family the exporter can produce: full cache snapshot, fixture host, real statvfs."""
    host = fixture_host_snapshot()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(full_cache_snapshot))
    registry.register(HostCollector(l3_root, sample_fn=lambda previous: host))
    registry.register(ServingProcessCollector(l3_root))  # this process, as kvtier serve's
    return registry


@dataclass
class PlanStandIn:
    """What `ServerMetrics.gpu_memory_plan` reads of kvtier.server.devices.memplan.DeviceMemoryPlan (its
    interface, without torch or a GPU): the parts in plan order, their sum, the bytes held now."""

    parts_bytes: dict[str, int]
    used: int

    @property
    def budget_bytes(self) -> int:
        return sum(self.parts_bytes.values())

    def parts(self) -> dict[str, int]:
        return dict(self.parts_bytes)

    def used_bytes(self) -> int:
        return self.used


def h200_plan(used: int = 100 * GIB) -> PlanStandIn:
    """The plan of an H200 (141 GB) at 0.9: 126.9 GB, the page pool getting what is left."""
    parts = {
        "context": 800 << 20,
        "weights": 16 * GIB,
        "activations": 3 * GIB,
        "graphs": 2 * GIB,
        "staging": 512 << 20,
        "l1": 160 << 20,
        "inflight": 512 << 20,
        "pool": 0,
        "headroom": 512 << 20,
    }
    parts["pool"] = int(141 * 1e9 * 0.9) - sum(parts.values())
    return PlanStandIn(parts, used)


def server_registry(plan: PlanStandIn | None = None) -> CollectorRegistry:
    """`kvtier serve`'s own families (kvtier.server.metrics), each with a sample: a placement
    with a lost device, a TTFT, a batch step, the page pool, a response, a 400 by reason, a
    turn's latencies and the GPU memory plan."""
    from kvtier.server.metrics import ServerMetrics
    from kvtier.server.reqmetrics import TurnClock

    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    metrics.devices(ok=1, lost=1, state="degraded", failover_s=2.5)
    metrics.ttft("l2", 0.04)
    metrics.load(running=3, waiting=1)
    metrics.step(batch_size=4, seconds=0.02)
    metrics.pages(parked=10, free=4080, total=4096, page_bytes=8192)
    for name in ("prompt_tokens", "completion_tokens", "degraded_turns"):
        metrics.count(name, 2)
    metrics.request("/v1/chat/completions", 200)
    metrics.bad_request("context_length_exceeded")
    clock = TurnClock(1.0, metrics)
    clock.admit(1.01)
    for at in (1.05, 1.07, 1.09):
        clock.token(at)
    clock.ended()
    metrics.gpu_memory_plan(plan or h200_plan())
    return registry


def scrape(registry: CollectorRegistry) -> dict[str, tuple[str, set[str], dict]]:
    """Exposition name -> (type, label names, {sample name + sorted labels: value})."""
    out: dict[str, tuple[str, set[str], dict]] = {}
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: set[str] = set()
        samples: dict = {}
        for s in family.samples:
            labels |= set(s.labels) - {"le"}
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        out[name] = (family.type, labels, samples)
    return out
