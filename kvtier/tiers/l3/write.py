"""The L3 write path: temp file + fdatasync, then rename + directory fsync + index row.

Each chunk is checksummed and written to its own temp file beside its final name on the write
pool (or by the L3 writer process, through a `TempWriter`); then the renames, one fsync per
directory and one index commit cover the whole batch, shared with any put running concurrently
(group commit). A put that returned survives kill -9 and power loss; one that failed leaves
nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier import kvbin, sealing
from kvtier.errors import KvbinFormatError, StoreError, StoreFullError, StoreIOError
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.cap import SizeCap
from kvtier.tiers.l3.commit import GroupCommit
from kvtier.tiers.l3.index import ChunkRow, Index
from kvtier.tiers.l3.keys import Keyring
from kvtier.tiers.l3.layout import Layout, hex_key
from kvtier.tiers.l3.pools import IOPools
from kvtier.tiers.l3.stats import Counters

_CRC_BESIDE_WRITE = 1 << 20  # payloads from this size are checksummed on a worker during the write
_tmp_seq = itertools.count()
SEAL_BUFFER = "wseal"  # the scratch buffer a sealed chunk's ciphertext is written from

TempWriter = Callable[[ChunkHeader, str, bool, bool, "sealing.DataKey | None"], ChunkHeader]
"""(header, temp path, O_DIRECT wanted, keep page cache, data key to seal with or None) -> the
header as written."""


@dataclass(frozen=True)
class Written:
    """A chunk whose temp file is written and fdatasync'ed, waiting for its rename."""

    header: ChunkHeader
    tmp: Path
    final: Path


class ChunkWriter:
    """Puts chunks durably under the size cap; see the module docstring."""

    def __init__(
        self,
        layout: Layout,
        index: Index,
        pools: IOPools,
        counters: Counters,
        cap: SizeCap,
        *,
        checksum: str,
        direct_io: bool,
        keep_page_cache: bool,
        keyring: Keyring | None = None,
    ) -> None:
        self._layout = layout
        self._keyring = keyring
        self._index = index
        self._pools = pools
        self._counters = counters
        self._cap = cap
        self.checksum = checksum
        self.direct_io = direct_io
        self.keep_page_cache = keep_page_cache
        self.commit: GroupCommit[list[Written]] = GroupCommit(self._apply)

    def put_many(
        self, items: Sequence[tuple[ChunkHeader, Any]], writer: TempWriter | None = None
    ) -> list[ChunkHeader]:
        """Store chunks durably; returns their headers as written (with checksums)."""
        checked = [self._check_item(h, p) for h, p in items]
        if not checked:
            return []
        need = sum(kvbin.file_size(h.payload_len) for h, _ in checked)
        self._cap.reserve(need, {h.key for h, _ in checked})
        try:
            t0 = time.perf_counter()
            written = self._write_temps(checked, writer)
            self.commit.submit(written)
            elapsed = time.perf_counter() - t0
        finally:
            self._cap.release(need)
        self._counters.wrote(len(written), need, elapsed)
        return [w.header for w in written]

    def _check_item(self, header: ChunkHeader, payload: Any) -> tuple[ChunkHeader, memoryview]:
        view = memoryview(payload)
        if not view.c_contiguous:
            raise ValueError("payload must be a C-contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if header.payload_len != len(view):
            raise KvbinFormatError(
                f"chunk {hex_key(header.key)}: header says payload_len={header.payload_len} "
                f"but the payload has {len(view)} bytes; set payload_len=len(payload)"
            )
        header = replace(header, checksum=header.checksum or self.checksum)
        header.validate()
        return header, view

    def _write_temps(
        self, checked: list[tuple[ChunkHeader, memoryview]], writer: TempWriter | None = None
    ) -> list[Written]:
        """Write and fdatasync every chunk to a temp file, in parallel; all or nothing."""
        if len(checked) == 1:
            try:
                return [self._write_temp(*checked[0], writer)]
            except OSError as exc:
                raise self._write_error(exc, checked[0][0]) from exc
        pool = self._pools.pool("write")
        futures = [pool.submit(self._write_temp, h, v, writer) for h, v in checked]
        written: list[Written] = []
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

    def _apply(self, batches: list[list[Written]]) -> list[BaseException | None]:
        """Group-commit step: rename, fsync each directory once, then one index transaction."""
        errors: list[BaseException | None] = [None] * len(batches)
        for i, batch in enumerate(batches):
            renamed: list[Written] = []
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
            self._index.put_chunks(rows)
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
        self._counters.count("full_errors" if full else "io_errors")
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
        futures = [self._pools.pool("write").submit(l3_io.fsync_dir, d) for d in dirs]
        for fut in futures:
            fut.exception()
        for fut in futures:
            fut.result()

    def _temp_path(self, header: ChunkHeader) -> tuple[Path, Path]:
        """(temp file, final file) for a chunk; the temp file sits beside its final name."""
        final = self._layout.path(header.key, "hot")
        final.parent.mkdir(mode=0o700, exist_ok=True)
        return final.parent / f".{final.stem}.{os.getpid()}.{next(_tmp_seq)}.tmp", final

    def _write_temp(
        self, header: ChunkHeader, view: memoryview, writer: TempWriter | None = None
    ) -> Written:
        """Write one chunk to a temp file beside its final name and fdatasync it, here or
        through `writer` (the L3 writer process, which reads the same bytes from shared
        memory)."""
        tmp, final = self._temp_path(header)
        direct = self.direct_io and not self.keep_page_cache
        # Encrypted stores seal here, on the writer thread (or in the writer process): chunks
        # of a batch are sealed in parallel, never on the serving thread.
        seal = self._keyring.for_tenant(header.tenant) if self._keyring is not None else None
        if writer is not None:
            written = writer(header, str(tmp), direct, self.keep_page_cache, seal)
            return Written(written, tmp, final)
        if seal is not None:  # sealed piece by piece while earlier pieces are written
            with self._pools.borrow(_seal_size(len(view))) as stage:
                header = write_sealed_file(
                    header,
                    view,
                    str(tmp),
                    seal,
                    direct=direct,
                    keep_page_cache=self.keep_page_cache,
                    buffer=self._pools.buffer,
                    stage=stage,
                    pool=self._pools.pool("seal", 2 * self._pools.threads),
                )
            return Written(header, tmp, final)
        crc: Future[int] | None = None
        if len(view) >= _CRC_BESIDE_WRITE:
            crc = self._pools.pool("crc").submit(kvbin.checksum, header.checksum, view)
        header = write_chunk_file(
            header,
            view,
            str(tmp),
            direct=direct,
            keep_page_cache=self.keep_page_cache,
            buffer=self._pools.buffer,
            crc=crc,
        )
        return Written(header, tmp, final)

    def _write_error(self, exc: OSError, header: ChunkHeader | None) -> StoreError:
        what = f"chunk {hex_key(header.key)}" if header else "put"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._counters.count("full_errors")
            return StoreFullError(
                f"{what}: L3 filesystem under {self._layout.root} is full; nothing was stored. "
                "Free space (kvtier l3 gc --max-bytes ...) or move the store to a larger device"
            )
        self._counters.count("io_errors")
        return StoreIOError(f"{what}: write failed ({exc}); nothing was stored")


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_chunk_file(
    header: ChunkHeader,
    view: memoryview,
    tmp: str,
    *,
    direct: bool,
    keep_page_cache: bool,
    buffer: Callable[[str, int], memoryview],
    crc: Future[int] | None = None,
    seal: sealing.DataKey | None = None,
    pool: Executor | None = None,
) -> ChunkHeader:
    """Write a chunk to the new file `tmp` and fdatasync it; returns the header as written.

    With `seal` (a tenant data key) the file holds the payload's ciphertext and a v2 header
    (`write_sealed_file`, its pieces written on `pool` when given); `crc` must then be None.

    The payload goes first (at offset 4096), with O_DIRECT when `direct` and the filesystem
    allows it, while `crc` (a future computing its checksum from the same buffer) runs beside
    it, or the checksum is computed after; the header, which holds that checksum, follows at
    offset 0. On any error the temp file is removed. `buffer(name, size)` gives aligned
    scratch buffers of the calling thread. Used by the store's writer threads and by the L3
    writer process alike.
    """
    if seal is not None:
        if crc is not None:
            raise ValueError("a sealed chunk's checksum is the ciphertext's: pass crc=None")
        stage = buffer(SEAL_BUFFER, _seal_size(len(view)))
        return write_sealed_file(
            header, view, tmp, seal, direct=direct, keep_page_cache=keep_page_cache,
            buffer=buffer, stage=stage, pool=pool,
        )  # fmt: skip
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
        _finish_file(fd, buffer, header, value, direct, keep_page_cache)
    except BaseException:
        if crc is not None:
            crc.exception()  # it reads the caller's buffer: let it finish first
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return header


def _finish_file(
    fd: int,
    buffer: Callable[[str, int], memoryview],
    header: ChunkHeader,
    value: int,
    direct: bool,
    keep_page_cache: bool,
) -> None:
    """The header last (it names the payload's checksum), then one fdatasync for the file."""
    hdr = buffer("whdr", HEADER_SIZE)[:HEADER_SIZE]
    hdr[:] = kvbin.encode(header, value)
    l3_io.pwrite_all(fd, [hdr], 0)
    os.fdatasync(fd)
    if not direct and not keep_page_cache:
        l3_io.drop_cache(fd)


def _seal_size(payload_len: int) -> int:
    """Bytes of the scratch buffer a sealed payload is encrypted into: the padded payload,
    and room for the tag behind it."""
    return kvbin.padded(payload_len) + kvbin.ALIGN


SEAL_PIECE = 4 << 20  # a sealed payload is encrypted and written in pieces this big


def write_sealed_file(
    header: ChunkHeader,
    view: memoryview,
    tmp: str,
    key: sealing.DataKey,
    *,
    direct: bool,
    keep_page_cache: bool,
    buffer: Callable[[str, int], memoryview],
    stage: memoryview,
    pool: Executor | None = None,
) -> ChunkHeader:
    """Write a sealed chunk to the new file `tmp` and fdatasync it; returns its v2 header.

    The payload is encrypted (AES-256-GCM, one message) into the aligned `stage` in
    `SEAL_PIECE` pieces; each piece is checksummed and handed to `pool` to be written while
    the next one is sealed, so the encryption overlaps the device (without a pool the pieces
    are written in turn). The caller's payload is only read: L2 stays plaintext. The header,
    holding the tag and the ciphertext's checksum, is written last, as for a plain chunk.
    """
    n = len(view)
    size = kvbin.padded(n)
    if len(stage) < size + 15:
        raise ValueError(f"stage has {len(stage)} bytes, needs {size + 15}")
    sealer = sealing.PayloadSealer(key, header)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    writes: list[Future[int]] = []
    try:
        direct = direct and l3_io.set_direct(fd, True)
        value = 0
        for start in range(0, max(n, 1), SEAL_PIECE):
            end = min(n, start + SEAL_PIECE)
            sealer.update(view, stage, start, end)
            value = kvbin.checksum(header.checksum, stage[start:end], value)
            if end == n:  # the last piece carries the zero padding
                stage[n:size] = bytes(size - n)
                end = size
            part = stage[start:end]
            if pool is not None:
                writes.append(pool.submit(l3_io.pwrite_all, fd, [part], HEADER_SIZE + start))
            else:
                direct = _pwrite_direct(fd, part, HEADER_SIZE + start, direct)
        errors = [exc for exc in (w.exception() for w in writes) if exc is not None]
        if errors:
            if not (direct and all(getattr(e, "errno", None) == errno.EINVAL for e in errors)):
                raise errors[0]
            direct = False  # the device wants another alignment: write it all buffered
            l3_io.set_direct(fd, False)
            l3_io.pwrite_all(fd, [stage[:size]], HEADER_SIZE)
        header = replace(sealer.finish(), payload_crc=value)
        _finish_file(fd, buffer, header, value, direct, keep_page_cache)
    except BaseException:
        for w in writes:
            w.exception()  # they write `fd` and read `stage`: let them finish first
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return header


def _pwrite_direct(fd: int, part: memoryview, offset: int, direct: bool) -> bool:
    """pwrite; where O_DIRECT is refused for this alignment, switch the file to buffered.
    Returns whether the file is still written with O_DIRECT."""
    try:
        l3_io.pwrite_all(fd, [part], offset)
        return direct
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
    l3_io.set_direct(fd, False)
    l3_io.pwrite_all(fd, [part], offset)
    return False


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
