"""/proc/<pid>/io: a process's logical reads against the bytes it made storage fetch.

`rchar` counts bytes returned by read-like syscalls (page-cache hits included); `read_bytes`
counts bytes the process caused to be fetched from storage. Between two readings,
1 - Δread_bytes / Δrchar estimates the page-cache hit ratio of the process's reads. Needs
CONFIG_TASK_IO_ACCOUNTING (on in distribution kernels).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcIo:
    """The two counters the hit ratio needs, in bytes since the process started."""

    rchar: int
    read_bytes: int


def parse(text: str) -> ProcIo | None:
    """Parse /proc/<pid>/io; None when either counter is missing."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            try:
                values[key.strip()] = int(value)
            except ValueError:
                continue
    if "rchar" not in values or "read_bytes" not in values:
        return None
    return ProcIo(rchar=values["rchar"], read_bytes=values["read_bytes"])


def hit_ratio(before: ProcIo, after: ProcIo) -> float | None:
    """Share of logical reads served without storage I/O between two readings, 0..1.

    None when nothing was read. Readahead can fetch more than was asked (clamped to 0), and
    rchar includes sockets and pipes, so this is an estimate for a process whose reads are
    dominated by L3 chunk reads. O_DIRECT reads count in both counters and so read as misses,
    which is what they are: they bypass the page cache.
    """
    logical = after.rchar - before.rchar
    fetched = after.read_bytes - before.read_bytes
    if logical <= 0 or fetched < 0:
        return None
    return max(0.0, 1.0 - fetched / logical)
