"""/proc/meminfo: the memory figures that precede an OOM or a failed hugepage/pinned allocation.

Values in `kB` are KiB (the kernel prints pages << (PAGE_SHIFT - 10)); the HugePages_* lines
are page counts without unit. Keys appear and disappear across kernels (MemAvailable since
3.14, Hugetlb since 4.16, Zswap since 5.19), so every field is optional.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Meminfo:
    """Selected /proc/meminfo values in bytes (hugepage counts in pages); None when absent."""

    mem_total: int | None
    mem_free: int | None
    mem_available: int | None
    cached: int | None
    dirty: int | None
    writeback: int | None
    mlocked: int | None
    unevictable: int | None
    hugepages_total: int | None
    hugepages_free: int | None
    hugepages_reserved: int | None
    hugepages_surplus: int | None
    hugepage_size: int | None
    fields: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hugepages_available(self) -> int | None:
        """Pages of the pool a new mapping can still take: free minus reserved."""
        if self.hugepages_free is None or self.hugepages_reserved is None:
            return None
        return self.hugepages_free - self.hugepages_reserved


def parse(text: str) -> Meminfo:
    """Parse /proc/meminfo text: every `Key: value [kB]` line, kB turned into bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        values[key.strip()] = number * 1024 if parts[1:2] == ["kB"] else number
    get = values.get
    return Meminfo(
        mem_total=get("MemTotal"),
        mem_free=get("MemFree"),
        mem_available=get("MemAvailable"),
        cached=get("Cached"),
        dirty=get("Dirty"),
        writeback=get("Writeback"),
        mlocked=get("Mlocked"),
        unevictable=get("Unevictable"),
        hugepages_total=get("HugePages_Total"),
        hugepages_free=get("HugePages_Free"),
        hugepages_reserved=get("HugePages_Rsvd"),
        hugepages_surplus=get("HugePages_Surp"),
        hugepage_size=get("Hugepagesize"),
        fields=values,
    )
