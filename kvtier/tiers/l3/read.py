"""The L3 read path: locate the chunk's file, read it, verify it, quarantine it if corrupt.

A read picks its route per file: resident pages through the page cache, anything else with
O_DIRECT (buffered where the filesystem or the buffer refuses it). It verifies the header
checksum, the fingerprint and the payload checksum before returning; anything corrupt is a
typed error, a counter and a quarantined file, never data.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvtier import kvbin
from kvtier.errors import (
    ChecksumMismatch,
    ChunkNotFound,
    FingerprintMismatch,
    KvbinFormatError,
    MasterKeyRequired,
    StoreIOError,
)
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.sealing import PayloadOpener
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.access import AccessTimes
from kvtier.tiers.l3.index import ChunkRow, Index
from kvtier.tiers.l3.keys import Keyring
from kvtier.tiers.l3.layout import TIERS, Layout, hex_key, tier_of
from kvtier.tiers.l3.pools import IOPools
from kvtier.tiers.l3.stats import Counters

log = logging.getLogger("kvtier.tiers.l3")  # the store logs under one name
READ_PIECE = 4 << 20  # reads go in pieces this big, each checksummed while later ones are read
READ_WINDOW = 3  # pieces of one read in flight at once


class Quarantine:
    """Moves corrupt chunk files into `<root>/quarantine/` and drops their index rows."""

    def __init__(self, layout: Layout, index: Index, counters: Counters, *, read_only: bool):
        self._dir = layout.quarantine
        self._index = index
        self._counters = counters
        self.read_only = read_only

    def corrupt(self, key: bytes, path: Path, exc: KvbinFormatError) -> KvbinFormatError:
        """Count a corrupt chunk, move its file to quarantine and return the error to raise."""
        self._counters.count(
            "checksum_failures" if isinstance(exc, ChecksumMismatch) else "format_errors"
        )
        where = self.move(key, path)
        suffix = f"; file quarantined to {where}" if where else "; store is read-only, file left"
        return type(exc)(f"chunk {hex_key(key)}: {exc}{suffix}")

    def move(self, key: bytes, path: Path) -> Path | None:
        """Move a bad file into <root>/quarantine/ and drop its index row (not in read-only)."""
        if self.read_only:
            return None
        dest = self._dir / f"{path.stem}.{time.time_ns()}.kvbin"
        try:
            try:
                os.rename(path, dest)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(path, dest)
                _fsync_file(dest)
                os.unlink(path)
            l3_io.fsync_dir(self._dir)
            l3_io.fsync_dir(path.parent)
        except FileNotFoundError:
            dest = None  # type: ignore[assignment]
        self._index.delete_chunks([key])
        self._counters.count("quarantined")
        log.warning("L3 chunk %s quarantined to %s", hex_key(key), dest)
        return dest


class ChunkReader:
    """Reads and verifies chunks; `read_piece` and `read_window` shape each read."""

    def __init__(
        self,
        layout: Layout,
        index: Index,
        pools: IOPools,
        counters: Counters,
        access: AccessTimes,
        quarantine: Quarantine,
        lock: threading.Lock,
        *,
        read_only: bool,
        direct_io: bool,
        keyring: Keyring | None = None,
    ) -> None:
        self._layout = layout
        self._index = index
        self._keyring = keyring
        self._pools = pools
        self._counters = counters
        self._access = access
        self._quarantine = quarantine
        self._lock = lock
        self.read_only = read_only
        self.direct_io = direct_io
        self.read_piece = READ_PIECE
        self.read_window = READ_WINDOW
        self._warned_cold = False

    def probe_size(self, key: bytes) -> int:
        """The size of the chunk's file, found without the index (ChunkNotFound if none)."""
        for tier in TIERS:
            with contextlib.suppress(FileNotFoundError):
                return max(HEADER_SIZE, os.stat(self._layout.path(key, tier)).st_size)
        self._counters.count("misses")
        raise ChunkNotFound(f"chunk {hex_key(key)} is not in L3")

    def _locate(self, key: bytes) -> tuple[int, Path, bool]:
        """Open the chunk's file: (fd, path, indexed). Falls back to the files when unindexed."""
        row = self._index.get_chunk(key)
        tiers = [row.tier] if row else list(TIERS)
        for tier in tiers:
            path = self._layout.path(key, tier)
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC), path, row is not None
            except FileNotFoundError:
                continue
        if row and row.tier == "hot" and not self.read_only:
            self._index.delete_chunks([key])  # the file is gone: the files are the truth
        elif row:
            # A cold file may be missing only because the cold root is not the one it was moved
            # to: keep the row (fsck drops it if the file is really gone) and say so once.
            with self._lock:
                warned, self._warned_cold = self._warned_cold, True
            if not warned:
                log.warning(
                    "L3 cold chunk %s has no file under %s; if cold chunks were moved elsewhere, "
                    "set the cold root (l3_cold_root / --l3-cold-root) to that directory",
                    hex_key(key),
                    self._layout.dirs["cold"],
                )
        self._counters.count("misses")
        raise ChunkNotFound(f"chunk {hex_key(key)} is not in L3")

    def read(
        self,
        key: bytes,
        out: Any,
        *,
        fingerprint: bytes,
        verify: bool,
        expect: ChunkHeader | None = None,
    ) -> ChunkHeader:
        """Read chunk `key` into `out`; with `verify`, check the payload checksum too. With
        `expect` (the chunk the caller asked for: a cache knows its tokens, geometry, codec and
        tenant), a header that describes anything else is corrupt (`kvbin.check_expected`)."""
        t0 = time.perf_counter()
        fd, path, indexed = self._locate(key)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE or (size - HEADER_SIZE) % kvbin.ALIGN:
                raise KvbinFormatError(f"file size {size} is not header + 4096-aligned payload")
            view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
            body = size - HEADER_SIZE
            if len(view) < body:
                self._too_small(fd, size, len(view), key, fingerprint, expect)
            route = self._choose_route(fd, size, view)
            header, route = self._read_verified(
                fd, size, view, key, fingerprint, route, verify, expect
            )
        except KvbinFormatError as exc:
            raise self._quarantine.corrupt(key, path, exc) from None
        except OSError as exc:
            self._counters.count("io_errors")
            raise StoreIOError(
                f"chunk {hex_key(key)}: read failed ({exc}); treat as a miss and check the device "
                "(dmesg, smartctl)"
            ) from exc
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - t0
        self._counters.read(route, size, elapsed)
        flush = False
        if not self.read_only:
            flush = self._access.note(header.key)
        if not indexed and not self.read_only:
            self._index.put_chunks([ChunkRow(header, tier_of(path), size, time.time())])
        if flush:
            # The commit (an fsync) runs on a background thread, never on a restore's path.
            self._access.flush_soon()
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
        expect: ChunkHeader | None = None,
    ) -> tuple[ChunkHeader, str]:
        """Read header and payload into `view` and check both checksums, the fingerprint and
        (with `expect`) that the header describes the chunk asked for.

        The file is read in `read_piece` pieces, `read_window` of them in flight at once on the
        read pool (the device keeps a deep queue), while this thread checks the header and
        checksums each piece as it lands, in order: the checksum then costs about one piece's
        worth of time instead of the whole payload's. Nothing is returned, and no read is left
        running into `view`, before every check passed.

        A sealed chunk (encrypted store) is decrypted in place piece by piece instead, and its
        AES-GCM tag, which authenticates every byte of the ciphertext and the header's
        identity, is the payload check (the CRC of the ciphertext is for fsck, which needs no
        key). A tag mismatch is an `AuthenticationFailed`, a `ChecksumMismatch`.
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

        pool = (
            self._pools.pool("read", self._pools.threads * self.read_window)
            if len(spans) > 1
            else None
        )
        inflight: collections.deque[tuple[int, int, Future[tuple[int, str]]]] = collections.deque()
        todo = iter(spans)

        def issue() -> None:
            span = next(todo, None)
            if span is not None and pool is not None:
                inflight.append((*span, pool.submit(read, *span, route)))

        header: ChunkHeader | None = None
        opener: PayloadOpener | None = None
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
                    header = self._check_header(hdr, key, size, fingerprint, expect)
                    opener = self._opener(header)
                if opener is not None and off < header.payload_len:
                    opener.update(view, off, min(end, header.payload_len))
                elif verify and off < header.payload_len:
                    piece = view[off : min(end, header.payload_len)]
                    value = kvbin.checksum(header.checksum, piece, value)
        finally:
            for _, _, fut in inflight:  # never return while a read may still fill the buffer
                fut.exception()
        assert header is not None
        if opener is not None:
            opener.finish()
        elif verify:
            kvbin.verify_crc(header, value)
        return header, route

    def _opener(self, header: ChunkHeader) -> PayloadOpener | None:
        """The decryptor of a sealed chunk; None for a plain chunk of a plain store."""
        if not header.sealed:
            if self._keyring is not None:
                raise KvbinFormatError(
                    "an unencrypted chunk in an encrypted store: it was not written by this store"
                )
            return None
        if self._keyring is None:
            raise MasterKeyRequired(
                f"chunk {hex_key(header.key)} is sealed but this store is not encrypted; "
                "open the store it came from with its master key"
            )
        return PayloadOpener(self._keyring.by_id(header.key_id, header.tenant), header)

    def _check_header(
        self,
        hdr: memoryview,
        key: bytes,
        size: int,
        fingerprint: bytes,
        expect: ChunkHeader | None = None,
    ) -> ChunkHeader:
        """Decode the header (its checksum included) and check it names this chunk and model,
        and with `expect`, that it is the chunk asked for (tokens, geometry, codec, payload
        length, tenant): the file's payload is then exactly the bytes the caller uses."""
        header = kvbin.decode(hdr)
        if header.key != bytes(key):
            raise KvbinFormatError(f"file holds chunk {hex_key(header.key)}, not this one")
        if kvbin.file_size(header.payload_len) != size:
            raise KvbinFormatError(
                f"payload_len {header.payload_len} does not match file size {size}"
            )
        if header.fingerprint != bytes(fingerprint):
            self._counters.count("fingerprint_mismatches")
            raise FingerprintMismatch(
                f"chunk {hex_key(key)} was written for model fingerprint "
                f"{header.fingerprint.hex()}, not {bytes(fingerprint).hex()}; it is never "
                "used for this model (recompute instead)"
            )
        if expect is not None:
            kvbin.check_expected(header, expect)
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

    def _too_small(
        self,
        fd: int,
        size: int,
        have: int,
        key: bytes,
        fingerprint: bytes,
        expect: ChunkHeader | None,
    ) -> None:
        """The file does not fit `out`: corrupt (quarantined) unless its header is the chunk
        asked for, and then the caller's buffer is too small (its mistake, a ValueError)."""
        hdr = self._header_buffer()
        if l3_io.read_into(fd, [hdr], 0) != HEADER_SIZE:
            raise KvbinFormatError(f"short read of the header (file of {size} bytes)")
        header = self._check_header(hdr, key, size, fingerprint, expect)
        raise ValueError(
            f"chunk {hex_key(header.key)}: output buffer has {have} bytes, needs "
            f"{size - HEADER_SIZE} (payload padded to 4096); size it with kvbin.padded()"
        )

    def _header_buffer(self) -> memoryview:
        return self._pools.buffer("hdr", HEADER_SIZE)[:HEADER_SIZE]


def _done(n: int, route: str) -> Future[tuple[int, str]]:
    fut: Future[tuple[int, str]] = Future()
    fut.set_result((n, route))
    return fut


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
