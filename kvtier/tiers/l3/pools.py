"""The L3 store's worker threads and per-thread scratch buffers.

Named thread pools are created on first use: `write` (temp files, directory fsyncs), `crc`
(checksums beside a write), `read` (pieces of a read) and `touch` (access-time commits).
Writes run at background priority; reads are on a restore's critical path and do not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from kvtier.tiers.l3 import io as l3_io


class IOPools:
    """Named thread pools of `threads` workers each, and aligned buffers per calling thread."""

    def __init__(self, threads: int, lock: threading.Lock) -> None:
        self.threads = threads
        self._lock = lock
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._local = threading.local()
        self._shared: list[memoryview] = []  # idle staging buffers any thread may borrow

    def pool(self, name: str, threads: int | None = None) -> ThreadPoolExecutor:
        """The store's named thread pool, created on first use (writers, crc, readers)."""
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = ThreadPoolExecutor(
                    threads or self.threads,
                    thread_name_prefix=f"kvtier-l3{name}",
                    # writes run in the background; reads are on a restore's critical path
                    initializer=l3_io.background_thread,
                    initargs=(name != "read",),
                )
                self._pools[name] = pool
        return pool

    def buffer(self, name: str, size: int) -> memoryview:
        """A per-thread aligned buffer of at least `size` bytes, grown on demand."""
        buf = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            buf = l3_io.aligned_buffer(size)
            setattr(self._local, name, buf)
        return buf

    @contextlib.contextmanager
    def borrow(self, size: int) -> Iterator[memoryview]:
        """An aligned buffer of at least `size` bytes from a free list shared by every thread
        (a sealed write's ciphertext): a short-lived caller thread reuses buffers whose pages
        are already faulted in instead of growing its own."""
        with self._lock:
            fits = [b for b in self._shared if len(b) >= size]
            buf = fits[0] if fits else None
            if buf is not None:
                self._shared.remove(buf)
        if buf is None:
            buf = l3_io.aligned_buffer(size)
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._shared) < 2 * self.threads:
                    self._shared.append(buf)

    def shutdown(self) -> None:
        """Wait for every pool's work to finish and stop its threads."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
