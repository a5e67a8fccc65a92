"""/proc/diskstats and the iostat -x rates computed from two readings of it.

Field count by kernel (after major, minor and name): 11 up to 4.17; 15 since 4.18 (discards:
completed, merged, sectors, ms); 17 since 5.5 (flushes: completed, ms). A line therefore has 14,
18 or 20 fields. Sectors are always 512 bytes here, whatever the device's block size.

`rates()` follows sysstat (iostat.c, rd_stats.c compute_ext_disk_stats) so that its figures
match `iostat -x`; the formulas are in docs/collectors.md.
"""

from __future__ import annotations

from dataclasses import dataclass

SECTOR = 512


@dataclass(frozen=True)
class DiskStat:
    """Cumulative counters of one block device (ms are milliseconds of request time)."""

    major: int
    minor: int
    name: str
    reads: int
    reads_merged: int
    sectors_read: int
    read_ms: int
    writes: int
    writes_merged: int
    sectors_written: int
    write_ms: int
    in_flight: int
    io_ms: int  # time the device had at least one request in flight
    weighted_io_ms: int  # sum of request times: the queue-size integral
    discards: int = 0
    discards_merged: int = 0
    sectors_discarded: int = 0
    discard_ms: int = 0
    flushes: int = 0
    flush_ms: int = 0

    @property
    def read_bytes(self) -> int:
        return self.sectors_read * SECTOR

    @property
    def written_bytes(self) -> int:
        return self.sectors_written * SECTOR


@dataclass(frozen=True)
class IoRates:
    """`iostat -x` figures over one interval, in base units (seconds, bytes, ratios)."""

    interval_seconds: float
    reads_per_second: float
    writes_per_second: float
    read_bytes_per_second: float
    write_bytes_per_second: float
    read_await_seconds: float  # r_await: mean time of a read, queue + service
    write_await_seconds: float
    read_request_bytes: float  # rareq-sz
    write_request_bytes: float  # wareq-sz
    queue_size: float  # aqu-sz
    utilization: float  # %util / 100; misleading on NVMe (parallel queues), see docs


def parse(text: str) -> dict[str, DiskStat]:
    """Parse /proc/diskstats: device name -> counters. Lines of unknown shape are skipped."""
    disks: dict[str, DiskStat] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) not in (14, 18, 20):
            continue
        try:
            numbers = [int(value) for value in parts[3:]]
            major, minor = int(parts[0]), int(parts[1])
        except ValueError:
            continue
        extra = numbers[11:] + [0] * (17 - len(numbers))
        disks[parts[2]] = DiskStat(major, minor, parts[2], *numbers[:11], *extra)
    return disks


def _per_request(delta_ms: int, requests: int) -> float:
    return delta_ms / requests / 1000 if requests else 0.0


def rates(before: DiskStat, after: DiskStat, interval_seconds: float) -> IoRates | None:
    """iostat -x rates between two readings of the same device.

    None when the interval is not positive or a counter went backwards (the device was
    removed and re-added, or the readings belong to different devices).
    """
    if interval_seconds <= 0 or (before.major, before.minor) != (after.major, after.minor):
        return None
    fields = (
        "reads",
        "writes",
        "sectors_read",
        "sectors_written",
        "read_ms",
        "write_ms",
        "io_ms",
        "weighted_io_ms",
    )
    d = {name: getattr(after, name) - getattr(before, name) for name in fields}
    if any(value < 0 for value in d.values()):
        return None
    seconds = interval_seconds
    return IoRates(
        interval_seconds=seconds,
        reads_per_second=d["reads"] / seconds,
        writes_per_second=d["writes"] / seconds,
        read_bytes_per_second=d["sectors_read"] * SECTOR / seconds,
        write_bytes_per_second=d["sectors_written"] * SECTOR / seconds,
        read_await_seconds=_per_request(d["read_ms"], d["reads"]),
        write_await_seconds=_per_request(d["write_ms"], d["writes"]),
        read_request_bytes=d["sectors_read"] * SECTOR / d["reads"] if d["reads"] else 0.0,
        write_request_bytes=d["sectors_written"] * SECTOR / d["writes"] if d["writes"] else 0.0,
        queue_size=d["weighted_io_ms"] / 1000 / seconds,
        utilization=min(1.0, d["io_ms"] / 1000 / seconds),
    )
