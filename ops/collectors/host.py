"""`sample()`: one reading of every host source, as a frozen `HostSnapshot`.

Rates (iostat, the page-cache hit ratio) come from the `previous` snapshot the caller passes in;
nothing is kept between calls. A missing source gives None or an empty list, never an exception.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ops.collectors import disk, nvml, pagecache, pcie, proc, torch_alloc
from ops.parsers import buddyinfo, diskstats, meminfo, pressure, procio, vmstat
from ops.parsers.nvml import GpuReading


@dataclass(frozen=True)
class HostSnapshot:
    """Everything the collectors read at `taken_at` (time.monotonic() seconds)."""

    taken_at: float
    buddyinfo: buddyinfo.BuddyInfo | None = None
    meminfo: meminfo.Meminfo | None = None
    vmstat: vmstat.Vmstat | None = None
    pressure: dict[str, pressure.Pressure] = field(default_factory=dict)  # memory, io, cpu
    pagecache: pagecache.PageCacheReading | None = None
    disk: disk.DiskReading | None = None
    gpus: list[GpuReading] = field(default_factory=list)
    topology: list[pcie.TopologyFinding] = field(default_factory=list)
    torch_alloc: list[torch_alloc.TorchAllocState] | None = None
    io: procio.ProcIo | None = None  # this process's read counters, for the hit ratio


def sample(
    l3_root: str | None = None,
    *,
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    previous: HostSnapshot | None = None,
    nvml: bool = True,
    max_files: int = 64,
) -> HostSnapshot:
    """Read every source once. With `l3_root`, also the L3 drive, its page-cache residency and
    its PCIe placement; with `previous`, the iostat rates and hit ratio since that snapshot;
    `nvml=False` skips the GPU queries (they cost milliseconds per GPU)."""
    taken_at = time.monotonic()
    io = proc.read_io(proc_root)
    drive = cache = None
    topology: list[pcie.TopologyFinding] = []
    if l3_root is not None:
        device = disk.device_of(l3_root, sys_root=sys_root, proc_root=proc_root)
        if device is not None:
            drive = disk.read(l3_root, proc_root=proc_root, device=device)
            topology = pcie.read_topology(l3_root, sys_root, device=device)
        cache = pagecache.read(l3_root, max_files=max_files)
    if previous is not None:
        interval = taken_at - previous.taken_at
        if drive is not None and previous.disk is not None:
            rates = diskstats.rates(previous.disk.stat, drive.stat, interval)
            drive = replace(drive, rates=rates)
        if cache is not None and io is not None and previous.io is not None:
            cache = replace(cache, hit_ratio=procio.hit_ratio(previous.io, io))
    return HostSnapshot(
        taken_at=taken_at,
        buddyinfo=proc.read_buddyinfo(proc_root),
        meminfo=proc.read_meminfo(proc_root),
        vmstat=proc.read_vmstat(proc_root),
        pressure=proc.read_pressure(proc_root),
        pagecache=cache,
        disk=drive,
        gpus=nvml_read() if nvml else [],
        topology=topology,
        torch_alloc=torch_alloc.read(),
        io=io,
    )


def nvml_read() -> list[GpuReading]:
    return nvml.read()
