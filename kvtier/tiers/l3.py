"""L3: the SSD tier. One checksummed .kvbin file per chunk plus an SQLite index (DESIGN.md §4-5).

Layout: `<root>/{hot,cold}/<2 hex>/<key>.kvbin`, `<root>/index.sqlite`, `<root>/quarantine/`.
Writes are temp file + fdatasync + rename + directory fsync, so a `put` that returned survives
kill -9 and power loss. Reads verify the header checksum, the fingerprint and the payload checksum
before returning; anything corrupt is a typed error, a counter and a quarantined file, never data.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier import kvbin
from kvtier.errors import (
    ChecksumMismatch,
    ChunkNotFound,
    FingerprintMismatch,
    KvbinFormatError,
    StoreError,
    StoreFullError,
    StoreIOError,
    UnsafeRootError,
)
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers import l3_io
from kvtier.tiers.l3_commit import GroupCommit
from kvtier.tiers.l3_index import ChunkRow, Index, SessionRecord

__all__ = ["L3Stats", "L3Store", "SessionRecord"]

log = logging.getLogger(__name__)
TIERS = ("hot", "cold")
_TOUCH_BATCH = 256
READ_PIECE = 4 << 20  # reads go in pieces this big, each checksummed while later ones are read
READ_WINDOW = 3  # pieces of one read in flight at once
_CRC_BESIDE_WRITE = 1 << 20  # payloads from this size are checksummed on a worker during the write
_tmp_seq = itertools.count()


@dataclass(frozen=True)
class _Written:
    """A chunk whose temp file is written and fdatasync'ed, waiting for its rename."""

    header: ChunkHeader
    tmp: Path
    final: Path


@dataclass(frozen=True)
class L3Stats:
    """Occupancy and counters of one store (counters are totals since this process opened it)."""

    capacity_bytes: int
    used_bytes: int
    chunks: int
    sessions: int
    reads: int = 0
    reads_direct: int = 0  # served with O_DIRECT from the device
    reads_cached: int = 0  # served through the page cache because the pages were resident
    reads_buffered: int = 0  # buffered because the filesystem or buffer refused O_DIRECT
    misses: int = 0
    writes: int = 0
    checksum_failures: int = 0
    format_errors: int = 0
    fingerprint_mismatches: int = 0
    quarantined: int = 0
    full_errors: int = 0  # ENOSPC or size cap
    io_errors: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


_COUNTERS = tuple(
    f
    for f in L3Stats.__dataclass_fields__
    if f
    not in ("capacity_bytes", "used_bytes", "chunks", "sessions", "read_seconds", "write_seconds")
)


class L3Store:
    """A directory of .kvbin chunk files with an SQLite index; see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_page_cache: bool = False,
        max_bytes: int | None = None,
        read_only: bool = False,
        direct_io: bool = True,
        cold_dir: str | os.PathLike[str] | None = None,
        checksum: str | None = None,
        io_threads: int = 4,
    ) -> None:
        self.root = Path(root)
        self.keep_page_cache = keep_page_cache
        self.max_bytes = max_bytes
        self.read_only = read_only
        self.direct_io = direct_io
        self.checksum = checksum or kvbin.default_checksum()
        if self.checksum not in kvbin.available_checksums():
            raise StoreError(
                f"checksum {self.checksum!r} is not available here; use one of "
                f"{kvbin.available_checksums()}"
            )
        if max_bytes is not None and max_bytes <= 0:
            raise StoreError(f"max_bytes must be positive or None, got {max_bytes}")
        if io_threads < 1:
            raise StoreError(f"io_threads must be at least 1, got {io_threads}")
        self.io_threads = io_threads
        self.read_piece = READ_PIECE
        self.read_window = READ_WINDOW
        self._dirs = {"hot": self.root / "hot", "cold": Path(cold_dir or self.root / "cold")}
        self._quarantine = self.root / "quarantine"
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._seconds = {"read_seconds": 0.0, "write_seconds": 0.0}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._touched: dict[bytes, float] = {}
        self._reserved = 0  # bytes of puts in flight, counted against max_bytes
        self._room_lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._commit: GroupCommit[list[_Written]] = GroupCommit(self._apply)
        self._lockfd: int | None = None
        self._closed = False
        self._evict_listeners: list[EvictListener] = []
        self._prepare_root()
        self.index = Index(self.root, read_only=read_only)
        if not read_only:
            self._sweep_temp_files()

    # ---- setup -------------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        if not self.read_only:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_safe(self.root, writable=not self.read_only)
        if self.read_only:
            return
        for d in (*self._dirs.values(), self._quarantine):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_safe(d, writable=True)
        self._lockfd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            self._lockfd = None
            raise StoreError(
                f"another process (or another L3Store in this one) has {self.root} open for "
                "writing; close it first, or open this one with read_only=True"
            ) from None

    def _sweep_temp_files(self) -> None:
        """Remove temp files a crashed writer left (we hold the writer lock, so none is live)."""
        for d in self._dirs.values():
            for sub in _subdirs(d):
                for name in os.listdir(sub):
                    if name.endswith(".tmp"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(sub / name)

    def close(self) -> None:
        """Flush access times and release the index and the writer lock; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(sqlite3.Error, StoreError):
            self._flush_touches()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self.index.close()
        if self._lockfd is not None:
            os.close(self._lockfd)
            self._lockfd = None

    def add_evict_listener(self, fn: EvictListener) -> None:
        """Call `fn(keys)` after the store deleted chunks on its own: the size cap of a put,
        and `gc` (TTL / retention / LRU down to a size). Not for `delete` (the caller asked)
        nor for a read that fails (its typed error says so). `fn` runs in the thread that
        deleted, after the files and index rows are gone and outside the store's locks, so it
        may call back into the store; an exception from it is logged and otherwise ignored."""
        with self._lock:
            self._evict_listeners.append(fn)

    def _notify_evicted(self, keys: list[bytes]) -> None:
        """Tell the evict listeners about `keys` (call with none of the store's locks held)."""
        if not keys:
            return
        with self._lock:
            listeners = list(self._evict_listeners)
        for fn in listeners:
            try:
                fn(list(keys))
            except Exception:
                log.exception("L3 evict listener %r failed; the store carries on", fn)

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- paths -------------------------------------------------------------------------------

    def path(self, key: bytes, tier: str = "hot") -> Path:
        """Where the chunk `key` lives in `tier` (only the key names files)."""
        h = _hex(key)
        return self._dirs[tier] / h[:2] / f"{h}.kvbin"

    def dir(self, tier: str) -> Path:
        return self._dirs[tier]

    @staticmethod
    def aligned_buffer(nbytes: int) -> memoryview:
        """A page-aligned buffer (anonymous mmap) that O_DIRECT reads can target."""
        return l3_io.aligned_buffer(nbytes)

    # ---- writes ------------------------------------------------------------------------------

    def put(
        self, header: ChunkHeader, payload: Any, *, writer: TempWriter | None = None
    ) -> ChunkHeader:
        """Store one chunk durably; returns the header as written (with its checksums).

        `writer` writes the temp file instead of this process's threads (the L3 writer
        process, given the same bytes in shared memory); the rename, directory fsync and index
        commit stay here.
        """
        return self.put_many([(header, payload)], writer=writer)[0]

    def put_many(
        self, items: Sequence[tuple[ChunkHeader, Any]], *, writer: TempWriter | None = None
    ) -> list[ChunkHeader]:
        """Store chunks durably; returns their headers as written (with checksums).

        Each chunk is checksummed, written to its own temp file and fdatasync'ed on a pool of
        `io_threads` writers; then the renames, one fsync per directory and one index commit
        cover the whole batch, shared with any put running concurrently (group commit). Returns
        only when every file, its directory entry and its index row are durable.
        """
        self._check_writable()
        checked = [self._check_item(h, p) for h, p in items]
        if not checked:
            return []
        need = sum(kvbin.file_size(h.payload_len) for h, _ in checked)
        self._reserve(need, {h.key for h, _ in checked})
        try:
            t0 = time.perf_counter()
            written = self._write_temps(checked, writer)
            self._commit.submit(written)
            elapsed = time.perf_counter() - t0
        finally:
            with self._lock:
                self._reserved -= need
        with self._lock:
            self._counts["writes"] += len(written)
            self._counts["bytes_written"] += need
            self._seconds["write_seconds"] += elapsed
        return [w.header for w in written]

    def _check_item(self, header: ChunkHeader, payload: Any) -> tuple[ChunkHeader, memoryview]:
        view = memoryview(payload)
        if not view.c_contiguous:
            raise ValueError("payload must be a C-contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if header.payload_len != len(view):
            raise KvbinFormatError(
                f"chunk {_hex(header.key)}: header says payload_len={header.payload_len} but the "
                f"payload has {len(view)} bytes; set payload_len=len(payload)"
            )
        header = replace(header, checksum=header.checksum or self.checksum)
        header.validate()
        return header, view

    def _write_temps(
        self, checked: list[tuple[ChunkHeader, memoryview]], writer: TempWriter | None = None
    ) -> list[_Written]:
        """Write and fdatasync every chunk to a temp file, in parallel; all or nothing."""
        if len(checked) == 1:
            try:
                return [self._write_temp(*checked[0], writer)]
            except OSError as exc:
                raise self._write_error(exc, checked[0][0]) from exc
        pool = self._pool("write")
        futures = [pool.submit(self._write_temp, h, v, writer) for h, v in checked]
        written: list[_Written] = []
        failure: tuple[BaseException, ChunkHeader] | None = None
        for (h, _), fut in zip(checked, futures, strict=True):
            err = fut.exception()
            if err is None:
                written.append(fut.result())
            elif failure is None:
                failure = (err, h)
        if failure is None:
            return written
        _unlink_all(w.tmp for w in written)
        err, h = failure
        if isinstance(err, OSError):
            raise self._write_error(err, h) from err
        raise err

    def _apply(self, batches: list[list[_Written]]) -> list[BaseException | None]:
        """Group-commit step: rename, fsync each directory once, then one index transaction."""
        errors: list[BaseException | None] = [None] * len(batches)
        for i, batch in enumerate(batches):
            renamed: list[_Written] = []
            try:
                for w in batch:
                    os.rename(w.tmp, w.final)
                    renamed.append(w)
            except OSError as exc:
                _unlink_all([w.tmp for w in batch] + [w.final for w in renamed])
                errors[i] = self._write_error(exc, batch[len(renamed)].header)
        live = [b for b, err in zip(batches, errors, strict=True) if err is None]
        finals = [w.final for b in live for w in b]
        try:
            self._fsync_dirs({f.parent for f in finals})
        except OSError as exc:
            _unlink_all(finals)
            for i, err in enumerate(errors):
                if err is None:
                    errors[i] = self._write_error(exc, batches[i][0].header)
            return errors
        now = time.time()
        rows = [
            ChunkRow(w.header, "hot", kvbin.file_size(w.header.payload_len), now)
            for b in live
            for w in b
        ]
        try:
            self.index.put_chunks(rows)
        except sqlite3.Error as exc:
            # The files are durable but unindexed; remove them so a failed put leaves nothing.
            _unlink_all(finals)
            with contextlib.suppress(OSError):
                self._fsync_dirs({f.parent for f in finals})
            for i, err in enumerate(errors):
                if err is None:
                    errors[i] = self._index_error(exc)
        return errors

    def _index_error(self, exc: sqlite3.Error) -> StoreError:
        full = "full" in str(exc).lower()
        self._count("full_errors" if full else "io_errors")
        cls = StoreFullError if full else StoreIOError
        return cls(
            f"L3 index update failed ({exc}); the put was undone. "
            + ("Free space on the L3 filesystem or lower max_bytes." if full else "")
        )

    def _fsync_dirs(self, dirs: set[Path]) -> None:
        """fsync every directory, concurrently when there are several (the filesystem journal
        then commits them together)."""
        if len(dirs) <= 1:
            for d in dirs:
                l3_io.fsync_dir(d)
            return
        futures = [self._pool("write").submit(l3_io.fsync_dir, d) for d in dirs]
        for fut in futures:
            fut.exception()
        for fut in futures:
            fut.result()

    def _pool(self, name: str, threads: int | None = None) -> ThreadPoolExecutor:
        """The store's named thread pool, created on first use (writers, crc, readers)."""
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = ThreadPoolExecutor(
                    threads or self.io_threads,
                    thread_name_prefix=f"kvtier-l3{name}",
                    # writes run in the background; reads are on a restore's critical path
                    initializer=l3_io.background_thread,
                    initargs=(name != "read",),
                )
                self._pools[name] = pool
        return pool

    def _temp_path(self, header: ChunkHeader) -> tuple[Path, Path]:
        """(temp file, final file) for a chunk; the temp file sits beside its final name."""
        final = self.path(header.key, "hot")
        final.parent.mkdir(mode=0o700, exist_ok=True)
        return final.parent / f".{final.stem}.{os.getpid()}.{next(_tmp_seq)}.tmp", final

    def _write_temp(
        self, header: ChunkHeader, view: memoryview, writer: TempWriter | None = None
    ) -> _Written:
        """Write one chunk to a temp file beside its final name and fdatasync it, here or
        through `writer` (the L3 writer process, which reads the same bytes from shared
        memory)."""
        tmp, final = self._temp_path(header)
        direct = self.direct_io and not self.keep_page_cache
        if writer is not None:
            return _Written(writer(header, str(tmp), direct, self.keep_page_cache), tmp, final)
        crc: Future[int] | None = None
        if len(view) >= _CRC_BESIDE_WRITE:
            crc = self._pool("crc").submit(kvbin.checksum, header.checksum, view)
        header = write_chunk_file(
            header,
            view,
            str(tmp),
            direct=direct,
            keep_page_cache=self.keep_page_cache,
            buffer=self._buffer,
            crc=crc,
        )
        return _Written(header, tmp, final)

    def _buffer(self, name: str, size: int) -> memoryview:
        """A per-thread aligned buffer of at least `size` bytes, grown on demand."""
        buf = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            buf = l3_io.aligned_buffer(size)
            setattr(self._local, name, buf)
        return buf

    def _write_error(self, exc: OSError, header: ChunkHeader | None) -> StoreError:
        what = f"chunk {_hex(header.key)}" if header else "put"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._count("full_errors")
            return StoreFullError(
                f"{what}: L3 filesystem under {self.root} is full; nothing was stored. Free "
                "space (kvtier l3 gc --max-bytes ...) or move the store to a larger device"
            )
        self._count("io_errors")
        return StoreIOError(f"{what}: write failed ({exc}); nothing was stored")

    def _reserve(self, need: int, keep: set[bytes]) -> None:
        """Under a size cap, evict unreferenced chunks (LRU) until `need` more bytes fit beside
        the puts in flight, and count `need` as in flight (the caller releases it)."""
        if self.max_bytes is None:
            with self._lock:
                self._reserved += need
            return
        with self._room_lock:
            _, used = self.index.totals()
            with self._lock:
                used += self._reserved
            victims = []
            if used + need > self.max_bytes:
                for row in self.index.unreferenced_lru():
                    if used + need <= self.max_bytes:
                        break
                    if row.header.key in keep:
                        continue
                    victims.append(row)
                    used -= row.size
            if used + need > self.max_bytes:
                self._count("full_errors")
                raise StoreFullError(
                    f"L3 size cap {self.max_bytes} bytes reached and the remaining chunks are "
                    "referenced by sessions or being written; raise max_bytes or delete sessions"
                )
            if victims:
                self._delete_rows(victims)
                self._count("evictions", len(victims))
            with self._lock:
                self._reserved += need
        self._notify_evicted([r.header.key for r in victims])

    def _check_writable(self) -> None:
        if self.read_only:
            raise StoreError(f"L3 store at {self.root} was opened read_only; open it writable")
        if self._closed:
            raise StoreError("L3 store is closed")

    # ---- reads -------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.index.get_chunk(key) is not None

    def header(self, key: bytes) -> ChunkHeader | None:
        """The chunk's header as indexed (no file I/O), or None."""
        row = self.index.get_chunk(key)
        return row.header if row else None

    def get(self, key: bytes, out: Any, *, fingerprint: bytes) -> ChunkHeader:
        """Read chunk `key` into `out` (writable, >= padded payload length; 4096-aligned for
        O_DIRECT) after verifying both checksums and the fingerprint."""
        return self._read(key, out, fingerprint=fingerprint, verify=True)

    def get_bytes(self, key: bytes, *, fingerprint: bytes) -> tuple[ChunkHeader, bytes]:
        """Like `get`, allocating the buffer; returns (header, payload bytes)."""
        row = self.index.get_chunk(key)
        size = row.size if row else self._probe_size(key)
        buf = self.aligned_buffer(size - HEADER_SIZE)
        header = self.get(key, buf, fingerprint=fingerprint)
        return header, bytes(buf[: header.payload_len])

    def _probe_size(self, key: bytes) -> int:
        for tier in TIERS:
            with contextlib.suppress(FileNotFoundError):
                return max(HEADER_SIZE, os.stat(self.path(key, tier)).st_size)
        self._count("misses")
        raise ChunkNotFound(f"chunk {_hex(key)} is not in L3")

    def _locate(self, key: bytes) -> tuple[int, Path, bool]:
        """Open the chunk's file: (fd, path, indexed). Falls back to the files when unindexed."""
        row = self.index.get_chunk(key)
        tiers = [row.tier] if row else list(TIERS)
        for tier in tiers:
            path = self.path(key, tier)
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC), path, row is not None
            except FileNotFoundError:
                continue
        if row and not self.read_only:
            self.index.delete_chunks([key])  # the file is gone: the files are the truth
        self._count("misses")
        raise ChunkNotFound(f"chunk {_hex(key)} is not in L3")

    def _read(self, key: bytes, out: Any, *, fingerprint: bytes, verify: bool) -> ChunkHeader:
        self._check_open()
        t0 = time.perf_counter()
        fd, path, indexed = self._locate(key)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE or (size - HEADER_SIZE) % kvbin.ALIGN:
                raise KvbinFormatError(f"file size {size} is not header + 4096-aligned payload")
            view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
            body = size - HEADER_SIZE
            if len(view) < body:
                self._too_small(fd, size, len(view))
            route = self._choose_route(fd, size, view)
            header, route = self._read_verified(fd, size, view, key, fingerprint, route, verify)
        except KvbinFormatError as exc:
            raise self._corrupt(key, path, exc) from None
        except OSError as exc:
            self._count("io_errors")
            raise StoreIOError(
                f"chunk {_hex(key)}: read failed ({exc}); treat as a miss and check the device "
                "(dmesg, smartctl)"
            ) from exc
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._counts["reads"] += 1
            self._counts[route] += 1
            self._counts["bytes_read"] += size
            self._seconds["read_seconds"] += elapsed
            if not self.read_only:
                self._touched[header.key] = time.time()
                flush = len(self._touched) >= _TOUCH_BATCH
            else:
                flush = False
        if not indexed and not self.read_only:
            self.index.put_chunks([ChunkRow(header, _tier_of(path), size, time.time())])
        if flush:
            self._flush_touches()
        return header

    def _read_verified(
        self,
        fd: int,
        size: int,
        view: memoryview,
        key: bytes,
        fingerprint: bytes,
        route: str,
        verify: bool,
    ) -> tuple[ChunkHeader, str]:
        """Read header and payload into `view` and check both checksums and the fingerprint.

        The file is read in `read_piece` pieces, `read_window` of them in flight at once on the
        read pool (the device keeps a deep queue), while this thread checks the header and
        checksums each piece as it lands, in order: the checksum then costs about one piece's
        worth of time instead of the whole payload's. Nothing is returned, and no read is left
        running into `view`, before every check passed.
        """
        hdr = self._header_buffer()
        body = size - HEADER_SIZE
        step = self.read_piece
        spans = [(off, min(body, off + step)) for off in range(0, max(body, 1), step)]

        def read(off: int, end: int, route: str) -> tuple[int, str]:
            if off == 0:
                n, route = self._read_at(fd, [hdr, view[:end]], 0, route)
                return n - HEADER_SIZE, route
            return self._read_at(fd, [view[off:end]], HEADER_SIZE + off, route)

        pool = self._pool("read", self.io_threads * self.read_window) if len(spans) > 1 else None
        inflight: collections.deque[tuple[int, int, Future[tuple[int, str]]]] = collections.deque()
        todo = iter(spans)

        def issue() -> None:
            span = next(todo, None)
            if span is not None and pool is not None:
                inflight.append((*span, pool.submit(read, *span, route)))

        header: ChunkHeader | None = None
        value = 0
        try:
            if pool is None:
                n, route = read(*spans[0], route)
                inflight.append((*spans[0], _done(n, route)))
            for _ in range(self.read_window):
                issue()
            while inflight:
                off, end, fut = inflight.popleft()
                n, route = fut.result()
                if n != end - off:
                    raise KvbinFormatError(
                        f"short read: {HEADER_SIZE + off + max(n, 0)} of {size} bytes "
                        "(file truncated?)"
                    )
                issue()
                if header is None:
                    header = self._check_header(hdr, key, size, fingerprint)
                if verify and off < header.payload_len:
                    piece = view[off : min(end, header.payload_len)]
                    value = kvbin.checksum(header.checksum, piece, value)
        finally:
            for _, _, fut in inflight:  # never return while a read may still fill the buffer
                fut.exception()
        assert header is not None
        if verify:
            kvbin.verify_crc(header, value)
        return header, route

    def _check_header(
        self, hdr: memoryview, key: bytes, size: int, fingerprint: bytes
    ) -> ChunkHeader:
        """Decode the header (its checksum included) and check it names this chunk and model."""
        header = kvbin.decode(hdr)
        if header.key != bytes(key):
            raise KvbinFormatError(f"file holds chunk {_hex(header.key)}, not this one")
        if kvbin.file_size(header.payload_len) != size:
            raise KvbinFormatError(
                f"payload_len {header.payload_len} does not match file size {size}"
            )
        if header.fingerprint != bytes(fingerprint):
            self._count("fingerprint_mismatches")
            raise FingerprintMismatch(
                f"chunk {_hex(key)} was written for model fingerprint "
                f"{header.fingerprint.hex()}, not {bytes(fingerprint).hex()}; it is never "
                "used for this model (recompute instead)"
            )
        return header

    @staticmethod
    def _read_at(fd: int, parts: list[memoryview], offset: int, route: str) -> tuple[int, str]:
        """preadv; where O_DIRECT is refused for this alignment, switch the file to buffered."""
        try:
            return l3_io.read_into(fd, parts, offset), route
        except OSError as exc:
            if exc.errno != errno.EINVAL or route != "reads_direct":
                raise
        l3_io.set_direct(fd, False)
        return l3_io.read_into(fd, parts, offset), "reads_buffered"

    def _choose_route(self, fd: int, size: int, view: memoryview) -> str:
        """Resident pages are read through the page cache; anything else with O_DIRECT."""
        if not self.direct_io:
            return "reads_buffered"
        pages = l3_io.cached_pages(fd, size)
        if pages is not None and pages * l3_io.PAGE >= size:
            return "reads_cached"
        addr = l3_io.address(view)
        if addr is None or addr % kvbin.ALIGN:
            return "reads_buffered"  # caller's buffer is not aligned: O_DIRECT would EINVAL
        return "reads_direct" if l3_io.set_direct(fd, True) else "reads_buffered"

    def _too_small(self, fd: int, size: int, have: int) -> None:
        hdr = self._header_buffer()
        l3_io.read_into(fd, [hdr], 0)
        header = kvbin.decode(hdr)
        if kvbin.file_size(header.payload_len) != size:
            raise KvbinFormatError(f"payload_len {header.payload_len} does not match size {size}")
        raise ValueError(
            f"chunk {_hex(header.key)}: output buffer has {have} bytes, needs "
            f"{size - HEADER_SIZE} (payload padded to 4096); size it with kvbin.padded()"
        )

    def _header_buffer(self) -> memoryview:
        return self._buffer("hdr", HEADER_SIZE)[:HEADER_SIZE]

    def _corrupt(self, key: bytes, path: Path, exc: KvbinFormatError) -> KvbinFormatError:
        """Count a corrupt chunk, move its file to quarantine and return the error to raise."""
        self._count("checksum_failures" if isinstance(exc, ChecksumMismatch) else "format_errors")
        where = self.quarantine(key, path)
        suffix = f"; file quarantined to {where}" if where else "; store is read-only, file left"
        return type(exc)(f"chunk {_hex(key)}: {exc}{suffix}")

    def quarantine(self, key: bytes, path: Path) -> Path | None:
        """Move a bad file into <root>/quarantine/ and drop its index row (not in read-only)."""
        if self.read_only:
            return None
        dest = self._quarantine / f"{path.stem}.{time.time_ns()}.kvbin"
        try:
            try:
                os.rename(path, dest)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(path, dest)
                _fsync_file(dest)
                os.unlink(path)
            l3_io.fsync_dir(self._quarantine)
            l3_io.fsync_dir(path.parent)
        except FileNotFoundError:
            dest = None  # type: ignore[assignment]
        self.index.delete_chunks([key])
        self._count("quarantined")
        log.warning("L3 chunk %s quarantined to %s", _hex(key), dest)
        return dest

    # ---- delete / maintenance helpers --------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove a chunk (file and index row); True if it existed."""
        self._check_writable()
        row = self.index.get_chunk(key)
        existed = False
        for tier in TIERS:
            path = self.path(key, tier)
            try:
                os.unlink(path)
                existed = True
                l3_io.fsync_dir(path.parent)
            except FileNotFoundError:
                pass
        self.index.delete_chunks([key])
        with self._lock:
            self._touched.pop(bytes(key), None)
        return existed or row is not None

    def _delete_rows(self, rows: Iterable[ChunkRow]) -> None:
        dirs = set()
        keys = []
        for row in rows:
            path = self.path(row.header.key, row.tier)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            dirs.add(path.parent)
            keys.append(row.header.key)
        for d in dirs:
            l3_io.fsync_dir(d)
        self.index.delete_chunks(keys)

    def _flush_touches(self) -> None:
        with self._lock:
            stamps, self._touched = self._touched, {}
        if stamps:
            try:
                self.index.touch(stamps)
            except sqlite3.Error as exc:  # e.g. disk full: access times are best effort
                log.warning("L3 access times not recorded: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("L3 store is closed")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # ---- sessions ----------------------------------------------------------------------------

    def save_session(self, record: SessionRecord) -> None:
        """Persist a session (replacing any with the same id and tenant) in one commit."""
        self._check_writable()
        self.index.save_session(record)

    def load_session(self, session_id: str, tenant: str) -> SessionRecord | None:
        return self.index.load_session(session_id, tenant)

    def list_sessions(self) -> list[SessionRecord]:
        return self.index.list_sessions()

    def delete_session(self, session_id: str, tenant: str) -> bool:
        self._check_writable()
        return self.index.delete_session(session_id, tenant)

    # ---- stats -------------------------------------------------------------------------------

    def stats(self) -> L3Stats:
        chunks, used = self.index.totals()
        if self.max_bytes is not None:
            capacity = self.max_bytes
        else:
            st = os.statvfs(self._dirs["hot"] if self._dirs["hot"].exists() else self.root)
            capacity = st.f_blocks * st.f_frsize
        with self._lock:
            counts = dict(self._counts)
            seconds = dict(self._seconds)
        return L3Stats(
            capacity_bytes=capacity,
            used_bytes=used,
            chunks=chunks,
            sessions=self.index.session_count(),
            read_seconds=seconds["read_seconds"],
            write_seconds=seconds["write_seconds"],
            **counts,
        )


# ---- helpers ---------------------------------------------------------------------------------


def _hex(key: bytes) -> str:
    if len(key) != kvbin.KEY_SIZE:
        raise ValueError(f"chunk key must be {kvbin.KEY_SIZE} bytes, got {len(key)}")
    return bytes(key).hex()


def _tier_of(path: Path) -> str:
    return "cold" if path.parent.parent.name == "cold" else "hot"


def _subdirs(base: Path) -> list[Path]:
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return [base / n for n in sorted(names) if len(n) == 2 and (base / n).is_dir()]


def _done(n: int, route: str) -> Future[tuple[int, str]]:
    fut: Future[tuple[int, str]] = Future()
    fut.set_result((n, route))
    return fut


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_safe(path: Path, *, writable: bool) -> None:
    """Refuse a directory that another user owns or that anyone may write to."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StoreError(
            f"L3 root {path} does not exist; create it or open the store writable"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRootError(f"L3 root {path} is not a directory; point the store at a directory")
    euid = os.geteuid()
    if st.st_uid != euid and (writable or euid != 0):
        raise UnsafeRootError(
            f"L3 directory {path} is owned by uid {st.st_uid}, not by this user (uid {euid}); "
            f"run as its owner or `chown -R {euid} {path}`"
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeRootError(
            f"L3 directory {path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}): anyone "
            f"could plant chunks; run `chmod 700 {path}`"
        )


EvictListener = Callable[[list[bytes]], None]
"""Called with the keys of chunks the store deleted by itself (see `add_evict_listener`)."""

TempWriter = Callable[[ChunkHeader, str, bool, bool], ChunkHeader]
"""(header, temp path, O_DIRECT wanted, keep page cache) -> the header as written."""


def write_chunk_file(
    header: ChunkHeader,
    view: memoryview,
    tmp: str,
    *,
    direct: bool,
    keep_page_cache: bool,
    buffer: Callable[[str, int], memoryview],
    crc: Future[int] | None = None,
) -> ChunkHeader:
    """Write a chunk to the new file `tmp` and fdatasync it; returns the header as written.

    The payload goes first (at offset 4096), with O_DIRECT when `direct` and the filesystem
    allows it, while `crc` (a future computing its checksum from the same buffer) runs beside
    it, or the checksum is computed after; the header, which holds that checksum, follows at
    offset 0. On any error the temp file is removed. `buffer(name, size)` gives aligned
    scratch buffers of the calling thread. Used by the store's writer threads and by the L3
    writer process alike.
    """
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        direct = direct and l3_io.set_direct(fd, True)
        if direct:
            try:
                l3_io.pwrite_all(fd, _direct_segments(view, buffer), HEADER_SIZE)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False  # the device wants another alignment: write buffered
                l3_io.set_direct(fd, False)
                os.ftruncate(fd, 0)
        if not direct:
            pad = kvbin.padded(len(view)) - len(view)
            l3_io.pwrite_all(fd, [view, bytes(pad)], HEADER_SIZE)
        value = crc.result() if crc else kvbin.checksum(header.checksum, view)
        header = replace(header, payload_crc=value)
        hdr = buffer("whdr", HEADER_SIZE)[:HEADER_SIZE]
        hdr[:] = kvbin.encode(header, value)
        l3_io.pwrite_all(fd, [hdr], 0)
        os.fdatasync(fd)
        if not direct and not keep_page_cache:
            l3_io.drop_cache(fd)
    except BaseException:
        if crc is not None:
            crc.exception()  # it reads the caller's buffer: let it finish first
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return header


def _direct_segments(
    view: memoryview, buffer: Callable[[str, int], memoryview]
) -> list[memoryview]:
    """4096-aligned buffers of the padded payload for an O_DIRECT pwritev: the caller's
    payload itself when it is aligned (pinned slots are), else a copy in a scratch buffer."""
    body = len(view) - len(view) % kvbin.ALIGN
    addr = l3_io.address(view) if body else None
    if addr is not None and addr % kvbin.ALIGN == 0:
        segments = [view[:body]]
        if body < len(view):
            tail = buffer("wtail", kvbin.ALIGN)
            rest = len(view) - body
            tail[:rest] = view[body:]
            tail[rest : kvbin.ALIGN] = bytes(kvbin.ALIGN - rest)
            segments.append(tail[: kvbin.ALIGN])
        return segments
    size = kvbin.padded(len(view))
    stage = buffer("wstage", size)
    stage[: len(view)] = view
    stage[len(view) : size] = bytes(size - len(view))
    return [stage[:size]]
