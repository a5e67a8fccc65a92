"""Host-side families: parsed /proc, sysfs and NVML readings in, Prometheus metric families out.

Each builder takes the parsers' dataclasses (None where the source does not exist on this host:
no PSI in an old kernel, no GPU) and yields nothing for a missing source instead of raising, so
one missing file never costs the rest of a scrape. Label names mirror node_exporter's (`device`,
`node`, `zone`) so queries can join with it. Counters come straight from the kernel's
cumulative counters; Prometheus computes the rates, the exporter keeps no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ops.collectors.host import HostSnapshot
from ops.collectors.torch_alloc import TorchAllocState
from ops.parsers.buddyinfo import BuddyInfo
from ops.parsers.diskstats import DiskStat
from ops.parsers.meminfo import Meminfo
from ops.parsers.nvml import GpuReading, normalize_bus_id
from ops.parsers.pressure import Pressure
from ops.parsers.vmstat import Vmstat

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield CounterMetricFamily(name, doc, value=value)


def pressure_families(memory: Pressure | None, io: Pressure | None) -> Iterator[Metric]:
    """PSI totals as counters (node_exporter's node_pressure_* names, with our prefix)."""
    for resource, p in (("memory", memory), ("io", io)):
        if p is None:
            continue
        if p.some is not None:
            yield from _counter(
                f"kvtier_pressure_{resource}_waiting_seconds",
                f"Time at least one task stalled on {resource} (PSI some).",
                p.some.total_seconds,
            )
        if p.full is not None:
            yield from _counter(
                f"kvtier_pressure_{resource}_stalled_seconds",
                f"Time all non-idle tasks stalled on {resource} (PSI full).",
                p.full.total_seconds,
            )


def memory_families(m: Meminfo | None, v: Vmstat | None, page_size: int) -> Iterator[Metric]:
    """Memory, hugepage, dirty-page and reclaim figures from /proc/meminfo and /proc/vmstat."""
    if m is not None:
        yield from _gauge("kvtier_memory_total_bytes", "MemTotal.", m.mem_total)
        yield from _gauge("kvtier_memory_available_bytes", "MemAvailable.", m.mem_available)
        yield from _gauge("kvtier_memory_cached_bytes", "Page cache (Cached).", m.cached)
        yield from _gauge("kvtier_memory_dirty_bytes", "Dirty page cache.", m.dirty)
        yield from _gauge("kvtier_memory_writeback_bytes", "Pages under writeback.", m.writeback)
        yield from _gauge("kvtier_memory_mlocked_bytes", "Locked memory (Mlocked).", m.mlocked)
        hugetlb = m.fields.get("Hugetlb")  # every pool size, Linux >= 4.16
        if hugetlb is None and m.hugepages_total is not None and m.hugepage_size is not None:
            hugetlb = m.hugepages_total * m.hugepage_size
        yield from _gauge(
            "kvtier_memory_hugetlb_bytes", "Memory held by hugetlb pools (Hugetlb).", hugetlb
        )
        yield from _gauge(
            "kvtier_hugepages_pool", "Pages in the default hugepage pool.", m.hugepages_total
        )
        yield from _gauge("kvtier_hugepages_free", "Free pages of the pool.", m.hugepages_free)
        yield from _gauge(
            "kvtier_hugepages_reserved",
            "Pool pages promised to mappings, not yet faulted.",
            m.hugepages_reserved,
        )
        yield from _gauge(
            "kvtier_hugepages_surplus", "Pages above the pool size.", m.hugepages_surplus
        )
        yield from _gauge("kvtier_hugepage_size_bytes", "Default hugepage size.", m.hugepage_size)
    if v is not None:
        for key, value, doc in (
            ("allocstall", v.allocstall, "Allocations that entered direct reclaim."),
            ("compact_stall", v.compact_stall, "Allocations that entered direct compaction."),
            ("compact_fail", v.compact_fail, "Direct compactions that failed."),
            ("pgmajfault", v.pgmajfault, "Major page faults."),
            ("workingset_refault", v.workingset_refault_file, "File pages refaulted."),
            ("pgscan_direct", v.pgscan_direct, "Pages scanned by direct reclaim."),
            ("oom_kill", v.oom_kill, "Processes killed by the OOM killer."),
        ):
            yield from _counter(f"kvtier_vmstat_{key}", doc, value)
        for name, pages, doc in (
            (
                "kvtier_memory_dirty_threshold_bytes",
                v.nr_dirty_threshold,
                "Dirty bytes at which writers are throttled (nr_dirty_threshold).",
            ),
            (
                "kvtier_memory_dirty_background_threshold_bytes",
                v.nr_dirty_background_threshold,
                "Dirty bytes at which background writeback starts.",
            ),
        ):
            yield from _gauge(name, doc, None if pages is None else pages * page_size)


def buddy_families(b: BuddyInfo | None) -> Iterator[Metric]:
    """Free blocks per order and the kernel's fragmentation index for 2 MiB blocks."""
    if b is None:
        return
    blocks = GaugeMetricFamily(
        "kvtier_buddyinfo_blocks",
        "Free blocks of 2**order pages.",
        labels=["node", "zone", "order"],
    )
    largest = GaugeMetricFamily(
        "kvtier_buddyinfo_largest_order",
        "Highest order with a free block (-1: no free page).",
        labels=["node", "zone"],
    )
    frag = GaugeMetricFamily(
        "kvtier_buddyinfo_fragmentation_index",
        "Kernel fragmentation index for a 2 MiB block: near 1 fails for fragmentation, near 0"
        " for lack of memory, -1 succeeds.",
        labels=["node", "zone"],
    )
    for z in b.zones:
        node = str(z.node)
        for order, count in enumerate(z.free_blocks):
            blocks.add_metric([node, z.name, str(order)], count)
        top = z.largest_order
        largest.add_metric([node, z.name], -1 if top is None else top)
        frag.add_metric([node, z.name], z.fragmentation_index(z.huge_order()))
    yield from (blocks, largest, frag)


def disk_families(disks: Iterable[DiskStat]) -> Iterator[Metric]:
    """/proc/diskstats counters of the L3 device(s), named as node_exporter's node_disk_*."""
    specs = (
        ("kvtier_disk_reads_completed", "Reads completed.", lambda d: d.reads, False),
        ("kvtier_disk_writes_completed", "Writes completed.", lambda d: d.writes, False),
        (
            "kvtier_disk_read_bytes",
            "Bytes read.",
            lambda d: d.sectors_read * SECTOR_BYTES,
            False,
        ),
        (
            "kvtier_disk_written_bytes",
            "Bytes written.",
            lambda d: d.sectors_written * SECTOR_BYTES,
            False,
        ),
        (
            "kvtier_disk_read_time_seconds",
            "Time reads spent queued and in service (r_await numerator).",
            lambda d: d.read_ms / 1000,
            False,
        ),
        (
            "kvtier_disk_write_time_seconds",
            "Time writes spent queued and in service (w_await numerator).",
            lambda d: d.write_ms / 1000,
            False,
        ),
        (
            "kvtier_disk_io_time_seconds",
            "Time with at least one request in flight (%util; misleading on NVMe).",
            lambda d: d.io_ms / 1000,
            False,
        ),
        (
            "kvtier_disk_io_time_weighted_seconds",
            "Sum of request times: its rate is the mean queue size (aqu-sz).",
            lambda d: d.weighted_io_ms / 1000,
            False,
        ),
        ("kvtier_disk_io_now", "Requests in flight.", lambda d: d.in_flight, True),
    )
    disks = list(disks)
    if not disks:
        return
    for name, doc, get, gauge in specs:
        family: GaugeMetricFamily | CounterMetricFamily = (
            GaugeMetricFamily(name, doc, labels=["device"])
            if gauge
            else CounterMetricFamily(name, doc, labels=["device"])
        )
        for d in disks:
            family.add_metric([d.name], get(d))
        yield family


def gpu_families(gpus: Iterable[GpuReading]) -> Iterator[Metric]:
    """NVML readings per GPU (label `gpu` = NVML index); a reading NVML lacks is left out."""
    gauges = (
        ("kvtier_gpu_memory_total_bytes", "Framebuffer size.", "memory_total_bytes"),
        ("kvtier_gpu_memory_used_bytes", "Framebuffer in use.", "memory_used_bytes"),
        ("kvtier_gpu_memory_free_bytes", "Framebuffer free.", "memory_free_bytes"),
        (
            "kvtier_gpu_memory_reserved_bytes",
            "Framebuffer reserved by the driver.",
            "memory_reserved_bytes",
        ),
        (
            "kvtier_gpu_pcie_tx_bytes_per_second",
            "PCIe throughput GPU to host (NVML 20 ms sample).",
            "pcie_tx_bytes_per_second",
        ),
        (
            "kvtier_gpu_pcie_rx_bytes_per_second",
            "PCIe throughput host to GPU (NVML 20 ms sample).",
            "pcie_rx_bytes_per_second",
        ),
        ("kvtier_gpu_pcie_link_generation", "Current PCIe link generation.", "link_gen"),
        (
            "kvtier_gpu_pcie_link_max_generation",
            "Highest generation GPU and slot support.",
            "link_gen_max",
        ),
        ("kvtier_gpu_pcie_link_width", "Current PCIe link width (lanes).", "link_width"),
        ("kvtier_gpu_pcie_link_max_width", "Maximum PCIe link width.", "link_width_max"),
        ("kvtier_gpu_utilization_ratio", "Share of time a kernel ran.", "utilization_gpu_ratio"),
    )
    gpus = list(gpus)
    if not gpus:
        return
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(name, doc, labels=["gpu"])
        for g in gpus:
            value = getattr(g, attr)
            if value is not None:
                family.add_metric([str(g.index)], value)
        yield family
    replays = CounterMetricFamily(
        "kvtier_gpu_pcie_replay", "PCIe replays (link-level retransmissions).", labels=["gpu"]
    )
    for g in gpus:
        if g.replay_counter is not None:
            replays.add_metric([str(g.index)], g.replay_counter)
    yield replays


def filesystem_families(size: int | None, avail: int | None) -> Iterator[Metric]:
    """Size and space available to kvtier (unprivileged) of the filesystem under the L3 root."""
    yield from _gauge("kvtier_l3_filesystem_size_bytes", "Size of the L3 filesystem.", size)
    yield from _gauge(
        "kvtier_l3_filesystem_avail_bytes",
        "Bytes of the L3 filesystem available to unprivileged writers.",
        avail,
    )


def pagecache_families(
    resident_ratio: float | None, hit_ratio: float | None, sampled_bytes: int | None
) -> Iterator[Metric]:
    """Page-cache residency of (a sample of) the L3 files, and the hit ratio of L3 reads."""
    yield from _gauge(
        "kvtier_l3_pagecache_resident_ratio",
        "Share of the sampled L3 file pages resident in the page cache.",
        resident_ratio,
    )
    yield from _gauge(
        "kvtier_l3_pagecache_sampled_bytes",
        "Bytes of L3 files the residency was measured on.",
        sampled_bytes,
    )
    yield from _gauge(
        "kvtier_l3_pagecache_hit_ratio",
        "Share of L3 reads served from the page cache since the previous scrape.",
        hit_ratio,
    )


# Closeness of a GPU and the L3 drive on the PCIe tree, as a number an alert or panel can compare.
PROXIMITY = {"none": 0, "host_bridge": 1, "root_port": 2, "switch": 3}


def topology_families(findings: Iterable[tuple[str, str, str]]) -> Iterator[Metric]:
    """(gpu label, L3 block device, sharing level) -> kvtier_gpu_l3_pcie_proximity."""
    findings = list(findings)
    if not findings:
        return
    family = GaugeMetricFamily(
        "kvtier_gpu_l3_pcie_proximity",
        "Where GPU and L3 drive paths meet: 0 apart, 1 host bridge, 2 root port, 3 switch"
        " (2 and 3 share an uplink: SSD traffic competes with host-GPU copies).",
        labels=["gpu", "device"],
    )
    for gpu, device, level in findings:
        family.add_metric([gpu, device], PROXIMITY.get(level, 0))
    yield family


def torch_families(states: Iterable[TorchAllocState]) -> Iterator[Metric]:
    """The CUDA caching allocator of this process, per device (in-process exporter only)."""
    states = list(states)
    if not states:
        return
    gauges = (
        ("kvtier_torch_reserved_bytes", "Bytes the allocator holds from CUDA.", "reserved_bytes"),
        ("kvtier_torch_allocated_bytes", "Bytes handed out to tensors.", "allocated_bytes"),
        (
            "kvtier_torch_inactive_split_bytes",
            "Free bytes stranded in split blocks (fragmentation).",
            "inactive_split_bytes",
        ),
        (
            "kvtier_torch_largest_free_block_bytes",
            "Largest free block inside reserved segments.",
            "largest_free_block_bytes",
        ),
    )
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(name, doc, labels=["gpu"])
        for s in states:
            family.add_metric([str(s.device)], getattr(s, attr))
        yield family
    for name, doc, attr in (
        (
            "kvtier_torch_alloc_retries",
            "cudaMalloc failures retried after a flush.",
            "alloc_retries",
        ),
        ("kvtier_torch_ooms", "Allocations that raised CUDA OOM.", "ooms"),
    ):
        counter = CounterMetricFamily(name, doc, labels=["gpu"])
        for s in states:
            counter.add_metric([str(s.device)], getattr(s, attr))
        yield counter


def snapshot_families(
    host: HostSnapshot, page_size: int, filesystem: tuple[int, int] | None = None
) -> Iterator[Metric]:
    """Every host family of one `HostSnapshot`; `filesystem` is the L3 (size, avail) bytes."""
    yield from pressure_families(host.pressure.get("memory"), host.pressure.get("io"))
    yield from memory_families(host.meminfo, host.vmstat, page_size)
    yield from buddy_families(host.buddyinfo)
    if host.pagecache is not None and host.pagecache.files:
        yield from pagecache_families(
            host.pagecache.resident_ratio, host.pagecache.hit_ratio, host.pagecache.bytes
        )
    if host.disk is not None:
        yield from disk_families([host.disk.stat])
    yield from gpu_families(host.gpus)
    index = {normalize_bus_id(g.bus_id): str(g.index) for g in host.gpus if g.bus_id}
    yield from topology_families(
        (index.get(normalize_bus_id(f.gpu), f.gpu), f.device, f.level) for f in host.topology
    )
    yield from torch_families(host.torch_alloc or ())
    if filesystem is not None:
        yield from filesystem_families(*filesystem)
