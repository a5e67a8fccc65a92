"""Page-cache residency of the L3 chunk files: `cachestat` (Linux >= 6.5), else mincore.

Residency says how much of the L3 data a read would find in RAM. The scan is bounded: at most
`max_files` files are looked at, walking the store's `{hot,cold}/<2 hex>/` shards in order.
Chunk keys are hashes, so the first shards are a uniform sample of the store, and the ratio
holds for the whole store. Files opened with O_DIRECT bypass the page cache: their reads never
hit it and never fill it (docs/collectors.md).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from kvtier.tiers.l3 import (
    io as l3_io,  # the one cachestat/mincore binding, shared with the L3 store
)

SUFFIX = ".kvbin"
PAGE = mmap.PAGESIZE

Method = Literal["cachestat", "mincore"]


@dataclass(frozen=True)
class Residency:
    """Pages of one file (or a sum of files) in the page cache; dirty/writeback/evicted only
    from cachestat (0 with mincore)."""

    pages: int
    cached: int
    dirty: int = 0
    writeback: int = 0
    evicted: int = 0
    recently_evicted: int = 0

    def __add__(self, other: Residency) -> Residency:
        return Residency(
            *(a + b for a, b in zip(_values(self), _values(other), strict=True)),
        )


def _values(r: Residency) -> tuple[int, int, int, int, int, int]:
    return (r.pages, r.cached, r.dirty, r.writeback, r.evicted, r.recently_evicted)


def cachestat(fd: int, size: int) -> Residency | None:
    """cachestat(2) over the whole file; None when the kernel lacks it (ENOSYS) or forbids it."""
    stat = l3_io.cachestat(fd)
    if stat is None:
        return None
    cached, dirty, writeback, evicted, recently_evicted = stat
    return Residency(
        pages=(size + PAGE - 1) // PAGE,
        cached=cached,
        dirty=dirty,
        writeback=writeback,
        evicted=evicted,
        recently_evicted=recently_evicted,
    )


def mincore(fd: int, size: int) -> Residency | None:
    """Residency through mmap + mincore(2), which works on every Linux; None on failure."""
    pages = (size + PAGE - 1) // PAGE
    cached = l3_io.mincore_pages(fd, size)
    return None if cached is None else Residency(pages=pages, cached=cached)


def _probe() -> bool:
    """Whether cachestat works here (Linux >= 6.5 and not blocked by seccomp)."""
    fd = os.open("/proc/self/exe", os.O_RDONLY)
    try:
        return l3_io.cachestat(fd) is not None
    finally:
        os.close(fd)


HAVE_CACHESTAT = _probe()


def residency(path: str, method: Method | None = None) -> tuple[Residency, Method] | None:
    """Residency of one file, by `method` (default: cachestat where the kernel has it)."""
    method = method or ("cachestat" if HAVE_CACHESTAT else "mincore")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        result = cachestat(fd, size) if method == "cachestat" else None
        if result is None:
            method = "mincore"
            result = mincore(fd, size)
        return None if result is None else (result, method)
    finally:
        os.close(fd)


def _chunk_files(root: str) -> Iterator[str]:
    """Chunk files in store order: hot shards, then cold; any other layout by a sorted walk."""
    tiers = [os.path.join(root, t) for t in ("hot", "cold") if os.path.isdir(os.path.join(root, t))]
    for top in tiers or [root]:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(SUFFIX):
                    yield os.path.join(dirpath, name)


@dataclass(frozen=True)
class PageCacheReading:
    """Residency of the L3 files looked at (a sample when `sampled`), and the hit ratio of the
    process's reads between two snapshots (None without a previous snapshot)."""

    files: int
    bytes: int
    residency: Residency
    method: Method | None
    sampled: bool
    hit_ratio: float | None = None

    @property
    def resident_ratio(self) -> float | None:
        """Cached pages over file pages, 0..1; None when no file was looked at."""
        pages = self.residency.pages
        return self.residency.cached / pages if pages else None


def read(l3_root: str, *, max_files: int = 64, method: Method | None = None) -> PageCacheReading:
    """Residency of up to `max_files` chunk files under `l3_root` (empty when there are none)."""
    total = Residency(0, 0)
    files = size = 0
    used: Method | None = None
    sampled = False
    for path in _chunk_files(l3_root):
        if files >= max_files:
            sampled = True
            break
        found = residency(path, method)
        if found is None:
            continue
        result, used = found
        total = total + result
        files += 1
        size += result.pages * PAGE
    return PageCacheReading(files=files, bytes=size, residency=total, method=used, sampled=sampled)
