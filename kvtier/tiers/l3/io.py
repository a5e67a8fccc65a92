"""Low-level file I/O of the L3 store: aligned buffers, full writes, directory fsync, O_DIRECT
switching and page-cache residency (cachestat on Linux >= 6.5, else mincore)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import threading
from collections.abc import Sequence
from typing import Any

from kvtier.tiers.libc import libc

PAGE = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451}.get(platform.machine())  # asm-generic table
_cachestat_ok = _CACHESTAT_NR is not None


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = (
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    )


BACKGROUND_NICE = 10
_background_cpus: set[int] | None = None  # where background disk threads may run (None: any)


def background_thread(nice: bool = True) -> None:
    """Lower the calling thread to nice 10 (Linux keeps a nice value per thread), and keep it on
    the CPUs `isolate_caller` left for background work, if it was called.

    Thread-pool initializer for disk work: L3 writes and their checksums (nice), and L3 reads
    (`nice=False`: a restore waits for them). On a serving host that work must not take CPU
    from the thread that drives the GPU. Best effort.
    """
    try:
        tid = threading.get_native_id()
        if nice and os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
        if _background_cpus:
            os.sched_setaffinity(0, _background_cpus)  # 0: this thread only
    except (OSError, AttributeError):  # not Linux, or not permitted: run at normal priority
        pass


def background_cpus() -> set[int] | None:
    """The CPUs `isolate_caller` left for background disk work, or None (any CPU)."""
    return _background_cpus


def forget_isolation() -> None:
    """Let later background threads run anywhere again (threads already placed stay)."""
    global _background_cpus
    _background_cpus = None


def core_siblings(cpu: int) -> set[int]:
    """`cpu` and the other hardware threads of its core (SMT siblings), from sysfs."""
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as f:
            return parse_cpu_list(f.read())
    except OSError:
        return {cpu}


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def isolate_caller(min_cpus: int = 4) -> tuple[set[int], set[int]] | None:
    """Give the calling thread a core of its own, away from background disk work.

    A decode loop is bound by one Python thread issuing kernels, and shares nothing with L3
    writes but the CPU; on a VM, a checksum running on the same core (or its SMT sibling) slows
    it by a third (docs/benchmarks.md, "Write-through interference"). This pins the caller to
    the last core it may use and makes every L3 pool thread started after this call use the
    other CPUs (call it before the cache is built: pool threads start on first use). Threads the
    caller starts later inherit its single core unless they move themselves. Returns (the
    caller's CPUs, the background CPUs), or None where the process has fewer than `min_cpus`
    CPUs or cannot set affinities (then nothing changes).
    """
    global _background_cpus
    try:
        allowed = os.sched_getaffinity(0)
        if len(allowed) < min_cpus:
            return None
        mine = core_siblings(max(allowed)) & allowed  # the last core: CPU 0 takes most IRQs
        rest = allowed - mine
        if not rest:
            return None
        os.sched_setaffinity(0, mine)
    except (OSError, AttributeError):
        return None
    _background_cpus = rest
    return mine, rest


def aligned_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer of at least `nbytes` (anonymous mmap)."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def address(buf: memoryview) -> int | None:
    """Start address of a writable buffer, or None when it cannot be taken."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


def cachestat(fd: int) -> tuple[int, int, int, int, int] | None:
    """cachestat(2) over the whole file: (cached, dirty, writeback, evicted, recently evicted)
    pages, or None where the kernel lacks it (< 6.5: ENOSYS) or forbids it (seccomp: EPERM)."""
    global _cachestat_ok
    if not _cachestat_ok:
        return None
    rng, stat = _CachestatRange(0, 0), _Cachestat()  # len 0: to the end of the file
    res = libc.syscall(_CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(stat), 0)
    if res == 0:
        return (
            int(stat.nr_cache),
            int(stat.nr_dirty),
            int(stat.nr_writeback),
            int(stat.nr_evicted),
            int(stat.nr_recently_evicted),
        )
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        _cachestat_ok = False
    return None


def have_cachestat() -> bool:
    return _cachestat_ok


def cached_pages(fd: int, size: int) -> int | None:
    """Pages of the open file resident in the page cache, or None when the kernel cannot say."""
    stat = cachestat(fd)
    return stat[0] if stat is not None else mincore_pages(fd, size)


def mincore_pages(fd: int, size: int) -> int | None:
    """Resident pages through mmap + mincore(2), which works on every Linux; None on failure."""
    if size <= 0:
        return 0
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = -(-size // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, vec) != 0:
            return None
        return sum(b & 1 for b in bytes(vec))
    finally:
        libc.munmap(addr, size)


def set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on an open file; False where the filesystem refuses it (tmpfs: EINVAL)."""
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | _O_DIRECT if on else flags & ~_O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes from `views`, after a vectored call moved only that many."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def write_all(fd: int, parts: Sequence[Any]) -> int:
    """Write every buffer in order with writev, resuming after short writes."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    total = 0
    while views:
        n = os.writev(fd, views[:1024])
        total += n
        _consume(views, n)
    return total


def pwrite_all(fd: int, parts: Sequence[Any], offset: int) -> int:
    """pwritev every buffer in order from `offset`, resuming after short writes."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    total = 0
    while views:
        n = os.pwritev(fd, views[:1024], offset + total)
        total += n
        _consume(views, n)
    return total


def read_into(fd: int, parts: Sequence[memoryview], offset: int) -> int:
    """preadv into the buffers from `offset`, resuming after short reads; returns bytes read."""
    views = [p for p in parts if len(p)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break  # end of file
        total += n
        _consume(views, n)
    return total


def fsync_dir(path: os.PathLike[str] | str) -> None:
    """fsync a directory so that a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(fd: int) -> None:
    """Drop the (clean) pages of a file from the page cache."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
