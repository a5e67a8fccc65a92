"""Alert thresholds: the one place their numbers live.

`dashboards/prometheus/alerts.yml` is rendered from these values by `ops.exporter.rules` (a test
fails when the checked-in file and the rendering differ), and kvtop judges "alerts that would
fire now" with the same values, so an operator never sees two opinions of one host.

Each `Threshold` carries the number its alert compares against (`value`), the optional second
condition (`rate`, a per-second rate), the look-back window of its `rate()`/`predict_linear()`
(`window_s`), the look-ahead of `predict_linear()` (`horizon_s`), a floor the measured amount
must also exceed (`floor`, so a ratio of a small quantity stays quiet) and how long the condition
must hold before the alert fires (`for_s`). Units are base units: ratios 0..1, bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    """One alert's numbers. `meaning` says in words what `value` (and `rate`) compare."""

    alert: str
    severity: str  # "warning" | "critical"
    value: float
    meaning: str
    for_s: int = 0
    window_s: int = 300
    rate: float = 0.0
    horizon_s: int = 0
    floor: float = 0.0


MEMORY_PSI_FULL = Threshold(
    "KvtierMemoryPressureFullStall",
    "critical",
    value=0.05,
    meaning="share of wall time (0..1) in which all non-idle tasks stalled on memory (PSI full)",
    for_s=300,
)
MEMORY_AVAILABLE = Threshold(
    "KvtierMemoryAvailableRunningOut",
    "critical",
    value=0.10,
    meaning=(
        "MemAvailable as a share of RAM outside the hugetlb pool is below `value` and, at the "
        "trend of the last `window_s`, reaches zero within `horizon_s`"
    ),
    for_s=300,
    window_s=1800,
    horizon_s=3600,
)
DIRECT_RECLAIM = Threshold(
    "KvtierDirectReclaimStalls",
    "warning",
    value=10.0,
    meaning="allocations per second that entered direct reclaim (vmstat allocstall_*)",
    for_s=600,
)
HIGH_ORDER_BLOCKS = Threshold(
    "KvtierHighOrderBlocksExhausted",
    "warning",
    value=1.0,
    meaning="free blocks of order >= 9 (2 MiB and up with 4 KiB pages) in a Normal zone, fewer than",
    for_s=900,
)
HUGEPAGE_POOL = Threshold(
    "KvtierHugepagePoolExhausted",
    "warning",
    value=1.0,
    meaning="hugepages free and not reserved in a configured pool, fewer than",
    for_s=300,
)
GPU_HEADROOM = Threshold(
    "KvtierGpuMemoryHeadroomLow",
    "critical",
    value=0.05,
    meaning="free framebuffer memory as a share (0..1) of the GPU's total, below",
    for_s=300,
)
L1_EVICTION_STORM = Threshold(
    "KvtierL1EvictionStorm",
    "warning",
    value=0.95,
    meaning="L1 use as a share of its budget is above `value` while more than `rate` chunks/s are evicted",
    for_s=600,
    rate=10.0,
)
L2_SLOTS = Threshold(
    "KvtierL2SlotsExhausted",
    "warning",
    value=0.99,
    meaning="L2 slots in use as a share of all slots is above `value` while more than `rate` chunks/s are evicted",
    for_s=900,
    rate=10.0,
)
L3_FILESYSTEM = Threshold(
    "KvtierL3FilesystemFilling",
    "warning",
    value=0.20,
    meaning=(
        "free space of the L3 filesystem as a share of its size is below `value` and, at the trend "
        "of the last `window_s`, reaches zero within `horizon_s`"
    ),
    for_s=1800,
    window_s=21600,
    horizon_s=86400,
)
L3_SHEDDING = Threshold(
    "KvtierL3WriteShedding",
    "warning",
    value=0.0,
    meaning="write-through copies dropped per second because a write queue was full, above",
    for_s=300,
)
CHECKSUM_FAILURE = Threshold(
    "KvtierChecksumFailure",
    "critical",
    value=0.0,
    meaning="chunks whose checksum failed within `window_s`, more than",
    window_s=900,
)
COMMIT_FAILURES = Threshold(
    "KvtierCommitFailures",
    "warning",
    value=0.0,
    meaning="finished turns whose commit failed within `window_s` (their replies were "
    "delivered; the K/V is recomputed), more than",
    window_s=900,
)
DEVICE_LOST = Threshold(
    "KvtierDeviceLost",
    "critical",
    value=0.0,
    meaning="devices of the model's placement marked lost, more than",
    for_s=0,
)
DIRTY_PAGES = Threshold(
    "KvtierDirtyPagesNearThreshold",
    "warning",
    value=0.80,
    meaning="dirty plus writeback pages as a share of the kernel's dirty threshold, above",
    for_s=600,
)
PCIE_DOWNGRADE = Threshold(
    "KvtierPcieLinkDowngraded",
    "warning",
    value=1.0,
    meaning=(
        "link width below its maximum, or link generation below its maximum while the link "
        "carries more than `rate` bytes/s (idle GPUs lower their generation to save power)"
    ),
    for_s=600,
    rate=1e9,
)
OOM_KILL = Threshold(
    "KvtierOomKillObserved",
    "critical",
    value=0.0,
    meaning="OOM kills (vmstat oom_kill) within `window_s`, more than",
    window_s=900,
)
GPU_ALLOC_RETRIES = Threshold(
    "KvtierGpuAllocatorRetries",
    "warning",
    value=0.0,
    meaning=(
        "cudaMalloc calls of the CUDA caching allocator that failed and were retried after it "
        "flushed its cache (torch num_alloc_retries), within `window_s`, more than"
    ),
    window_s=900,
)
GPU_ALLOC_FRAGMENTED = Threshold(
    "KvtierGpuAllocatorFragmented",
    "warning",
    value=0.25,
    meaning=(
        "free bytes stranded in split blocks (torch inactive_split_bytes) as a share of the bytes "
        "the allocator reserved is above `value`, and more than `floor` bytes are stranded"
    ),
    for_s=900,
    floor=1e9,
)
GPU_BUDGET = Threshold(
    "KvtierGpuBudgetExceeded",
    "warning",
    value=1.0,
    meaning=(
        "bytes the serving process holds on its GPU (torch's reserved memory) as a share of its "
        "GPU memory plan's budget (--gpu-memory-utilization), above"
    ),
    for_s=60,
)
L4_DOWN = Threshold(
    "KvtierL4Down",
    "critical",
    value=2.0,
    meaning=(
        "the L4 circuit breaker at `value` (open: kvtier_l4_breaker_state 2) or Redis reported "
        "unreachable (kvtier_l4_up 0)"
    ),
    for_s=300,
)
L4_ERRORS = Threshold(
    "KvtierL4Errors",
    "warning",
    value=0.1,
    meaning="failed L4 (Redis) operations per second over `window_s`, above",
    for_s=600,
)
L4_SHARD_NO_REPLICA = Threshold(
    "KvtierL4ShardNoReplica",
    "warning",
    value=1.0,
    meaning=(
        "replicas attached to a Redis Cluster shard's primary (kvtier_l4_shard_replicas), below: "
        "losing that primary loses its slots' chunks"
    ),
    for_s=300,
)
SESSION_MOVES = Threshold(
    "KvtierSessionMoves",
    "warning",
    value=0.05,
    meaning=(
        "sessions per second moved to this host over `window_s` (opened from the L4 record of "
        "another host that served them last), above, for `for_s`: a host that died moves its "
        "sessions once; one that keeps leaving and returning (flapping) moves them again and "
        "again"
    ),
    for_s=900,
    window_s=300,
)

ALL: tuple[Threshold, ...] = (
    MEMORY_PSI_FULL,
    MEMORY_AVAILABLE,
    DIRECT_RECLAIM,
    HIGH_ORDER_BLOCKS,
    HUGEPAGE_POOL,
    GPU_HEADROOM,
    L1_EVICTION_STORM,
    L2_SLOTS,
    L3_FILESYSTEM,
    L3_SHEDDING,
    CHECKSUM_FAILURE,
    COMMIT_FAILURES,
    DEVICE_LOST,
    DIRTY_PAGES,
    PCIE_DOWNGRADE,
    OOM_KILL,
    GPU_ALLOC_RETRIES,
    GPU_ALLOC_FRAGMENTED,
    GPU_BUDGET,
    L4_DOWN,
    L4_ERRORS,
    L4_SHARD_NO_REPLICA,
    SESSION_MOVES,
)
BY_ALERT: dict[str, Threshold] = {t.alert: t for t in ALL}
