"""L3: the SSD tier. One checksummed .kvbin file per chunk plus an SQLite index (docs/architecture.md, Tiers and Formats).

Layout: `<root>/{hot,cold}/<2 hex>/<key>.kvbin`, `<root>/index.sqlite`, `<root>/quarantine/`.
Writes are temp file + fdatasync + rename + directory fsync, so a `put` that returned survives
kill -9 and power loss. Reads verify the header checksum, the fingerprint and the payload checksum
before returning; anything corrupt is a typed error, a counter and a quarantined file, never data.

`L3Store` composes the parts, one concern each: the root and its writer lock (l3_root), the
file layout (l3_layout), the index (l3_index), worker threads (l3_pools), counters (l3_stats),
access times (l3_access), the size cap and evict listeners (l3_cap), the write path (l3_write)
and the read path with quarantine (l3_read).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier import kvbin, sealing
from kvtier.errors import AuthenticationFailed, StoreError, TenantKeyShredded
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.access import AccessTimes
from kvtier.tiers.l3.cap import EvictListener, SizeCap
from kvtier.tiers.l3.index import ChunkRow, Index, SessionRecord
from kvtier.tiers.l3.keys import Keyring, check_master_key, shred_records, tenant_chunk_keys
from kvtier.tiers.l3.layout import TIERS, Layout
from kvtier.tiers.l3.pools import IOPools
from kvtier.tiers.l3.read import READ_PIECE as READ_PIECE
from kvtier.tiers.l3.read import READ_WINDOW as READ_WINDOW
from kvtier.tiers.l3.read import ChunkReader, Quarantine
from kvtier.tiers.l3.root import COLD_ROOT_KEY, StoreInUse, check_safe, resolve_cold_root, take_lock
from kvtier.tiers.l3.stats import Counters, L3Stats
from kvtier.tiers.l3.write import ChunkWriter, TempWriter
from kvtier.tiers.l3.write import write_chunk_file as write_chunk_file

__all__ = ["L3Stats", "L3Store", "SessionRecord", "ShredReport", "StoreInUse"]
log = logging.getLogger("kvtier.tiers.l3")


@dataclass(frozen=True)
class ShredReport:
    """What `L3Store.shred_tenant` did: data keys destroyed, session records deleted, and the
    tenant's chunk files now unreadable (removed by the next gc; for a plain store, deleted)."""

    tenant: str
    keys: int
    sessions: int
    chunks: int
    encrypted: bool


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
        adopt_cold_root: bool = False,
        checksum: str | None = None,
        io_threads: int = 4,
        master_key: sealing.MasterKey | None = None,
        need_key: bool = False,
    ) -> None:
        """`cold_dir`: where cold chunks live (default `<root>/cold`). It is recorded in the
        index by the first writable open that names one (or by the first migrate); later opens
        that name none use the recorded one, and one naming another is refused (StoreError)
        unless `adopt_cold_root` (the files were moved there) records it instead.

        `master_key`: encrypt at rest (docs/security.md). A new, empty store records the key's
        id and seals every chunk payload and session record; an encrypted store refuses
        another key (MasterKeyError) before anything is read or deleted. Opened without its
        key an encrypted store is locked: gc, fsck, stats and shred work, reads and writes
        raise MasterKeyRequired; with `need_key` the open itself does."""
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
        self._layout = Layout(self.root)
        self._lock = threading.Lock()  # the store's lock for small shared state, never held long
        self._lockfd: int | None = None
        self._closed = False
        self._prepare_root()
        try:
            self.index = Index(self.root, read_only=read_only)
            try:
                self.master_key_id = check_master_key(
                    self.index, master_key, need_key=need_key, writable=not read_only
                )
                self.keyring = (
                    Keyring(self.index, master_key) if self.master_key_id is not None else None
                )
                self._layout.dirs["cold"] = resolve_cold_root(
                    self.index, self.root, cold_dir, writable=not read_only, adopt=adopt_cold_root
                )
                if not read_only:
                    self._layout.make_dirs()
                    self._layout.sweep_temp_files()
            except BaseException:
                self.index.close()
                raise
        except BaseException:
            if self._lockfd is not None:
                os.close(self._lockfd)
                self._lockfd = None
            raise
        self._compose()

    def _compose(self) -> None:
        """Build the parts that share the open index, the threads and the counters."""
        layout, index, lock = self._layout, self.index, self._lock
        self._threads = IOPools(self.io_threads, lock)
        self._counters = Counters(lock)
        self._access = AccessTimes(index, self._threads, lock)
        self._cap = SizeCap(self.max_bytes, index, self._counters, lock, self.delete_rows)
        self._writer = ChunkWriter(
            layout,
            index,
            self._threads,
            self._counters,
            self._cap,
            checksum=self.checksum,
            direct_io=self.direct_io,
            keep_page_cache=self.keep_page_cache,
            keyring=self.keyring,
        )
        self._quarantine = Quarantine(layout, index, self._counters, read_only=self.read_only)
        self._reader = ChunkReader(
            layout,
            index,
            self._threads,
            self._counters,
            self._access,
            self._quarantine,
            lock,
            read_only=self.read_only,
            direct_io=self.direct_io,
            keyring=self.keyring,
        )
        # What tests and benchmarks reach for on the store itself.
        self._room_lock = self._cap.room_lock
        self._commit = self._writer.commit
        self._pool = self._threads.pool

    # ---- setup -------------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        """Check the root (creating it private when writable) and take the writer lock."""
        if not self.read_only:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_safe(self.root, writable=not self.read_only)
        if not self.read_only:
            self._lockfd = take_lock(self.root)

    def record_cold_root(self) -> None:
        """Record the cold root in use unless one is (before chunks are moved there)."""
        self.check_writable()
        if self.index.get_meta(COLD_ROOT_KEY) is None:
            cold = self._layout.dirs["cold"]
            default = os.path.realpath(self.root / "cold") == os.path.realpath(cold)
            self.index.set_meta(COLD_ROOT_KEY, "" if default else str(cold.absolute()))

    def close(self) -> None:
        """Flush access times and release the index and the writer lock; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(sqlite3.Error, StoreError):
            self._access.flush()
        self._threads.shutdown()
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
        self._cap.add_listener(fn)

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_writable(self) -> None:
        """Raise StoreError unless the store is open and writable (before any change)."""
        if self.read_only:
            raise StoreError(f"L3 store at {self.root} was opened read_only; open it writable")
        if self._closed:
            raise StoreError("L3 store is closed")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("L3 store is closed")

    # ---- paths -------------------------------------------------------------------------------

    def path(self, key: bytes, tier: str = "hot") -> Path:
        """Where the chunk `key` lives in `tier` (only the key names files)."""
        return self._layout.path(key, tier)

    def dir(self, tier: str) -> Path:
        return self._layout.dirs[tier]

    @staticmethod
    def aligned_buffer(nbytes: int) -> memoryview:
        """A page-aligned buffer (anonymous mmap) that O_DIRECT reads can target."""
        return l3_io.aligned_buffer(nbytes)

    # ---- writes (l3_write) -------------------------------------------------------------------

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
        self.check_writable()
        return self._writer.put_many(items, writer)

    # ---- reads (l3_read) ---------------------------------------------------------------------

    @property
    def read_piece(self) -> int:
        """Reads go in pieces this big, each checksummed while later ones are read."""
        return self._reader.read_piece

    @read_piece.setter
    def read_piece(self, value: int) -> None:
        self._reader.read_piece = value

    @property
    def read_window(self) -> int:
        """Pieces of one read in flight at once."""
        return self._reader.read_window

    @read_window.setter
    def read_window(self, value: int) -> None:
        self._reader.read_window = value

    def contains(self, key: bytes) -> bool:
        return self.index.get_chunk(key) is not None

    def header(self, key: bytes) -> ChunkHeader | None:
        """The chunk's header as indexed (no file I/O), or None."""
        row = self.index.get_chunk(key)
        return row.header if row else None

    def get(
        self, key: bytes, out: Any, *, fingerprint: bytes, expect: ChunkHeader | None = None
    ) -> ChunkHeader:
        """Read chunk `key` into `out` (writable, >= padded payload length; 4096-aligned for
        O_DIRECT) after verifying both checksums and the fingerprint; with `expect`, the chunk
        the caller asked for, also that the header describes it (`kvbin.check_expected`)."""
        return self._read(key, out, fingerprint=fingerprint, verify=True, expect=expect)

    def get_bytes(self, key: bytes, *, fingerprint: bytes) -> tuple[ChunkHeader, bytes]:
        """Like `get`, allocating the buffer; returns (header, payload bytes)."""
        row = self.index.get_chunk(key)
        size = row.size if row else self._reader.probe_size(key)
        buf = self.aligned_buffer(size - HEADER_SIZE)
        header = self.get(key, buf, fingerprint=fingerprint)
        return header, bytes(buf[: header.payload_len])

    def _read(
        self,
        key: bytes,
        out: Any,
        *,
        fingerprint: bytes,
        verify: bool,
        expect: ChunkHeader | None = None,
    ) -> ChunkHeader:
        self._check_open()
        return self._reader.read(key, out, fingerprint=fingerprint, verify=verify, expect=expect)

    def quarantine(self, key: bytes, path: Path) -> Path | None:
        """Move a bad file into <root>/quarantine/ and drop its index row (not in read-only)."""
        return self._quarantine.move(key, path)

    # ---- delete ------------------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove a chunk (file and index row); True if it existed."""
        self.check_writable()
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
        self._access.forget(key)
        return existed or row is not None

    def delete_rows(self, rows: Iterable[ChunkRow]) -> None:
        """Remove the chunks of `rows` (files, then index rows) without telling the evict
        listeners: a caller that deleted on the store's own account calls `notify_evicted`."""
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

    def notify_evicted(self, keys: list[bytes]) -> None:
        """Tell the evict listeners (`add_evict_listener`) that the store deleted `keys` on its
        own (gc); call it outside the store's locks."""
        self._cap.notify(keys)

    # ---- maintenance hooks (l3_maint) --------------------------------------------------------

    def flush_touches(self) -> None:
        """Write the access times recorded since the last flush to the index now."""
        self._access.flush()

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to the counter `name` of `stats()` (e.g. "evictions")."""
        self._counters.count(name, n)

    # ---- sessions ----------------------------------------------------------------------------

    @property
    def encrypted(self) -> bool:
        """Chunk payloads and session token ids are sealed (AES-256-GCM) in this store."""
        return self.keyring is not None

    def save_session(self, record: SessionRecord) -> None:
        """Persist a session (replacing any with the same id and tenant) in one commit; in an
        encrypted store its token ids are sealed with the tenant's data key."""
        self.check_writable()
        if self.keyring is not None:
            key = self.keyring.for_tenant(record.tenant)
            sealed = sealing.seal_record(
                key, record.session_id, record.fingerprint, bytes(record.token_ids)
            )
            record = replace(record, token_ids=sealed, key_id=key.key_id)
        self.index.save_session(record)

    def load_session(self, session_id: str, tenant: str) -> SessionRecord | None:
        rec = self.index.load_session(session_id, tenant)
        return None if rec is None else self._open_record(rec)

    def list_sessions(self) -> list[SessionRecord]:
        """Every readable session record (token ids opened). Records of a shredded tenant, or
        failing their tag (then deleted), are left out. A store opened without its master key
        returns sealed records as stored (`key_id` set)."""
        records = (self._open_record(r) for r in self.index.list_sessions())
        return [r for r in records if r is not None]

    def _open_record(self, rec: SessionRecord) -> SessionRecord | None:
        if rec.key_id is None or self.keyring is None or self.keyring.locked:
            return rec
        try:
            key = self.keyring.by_id(rec.key_id, rec.tenant)
            data = sealing.open_record(key, rec.session_id, rec.fingerprint, rec.token_ids)
        except TenantKeyShredded:
            return None
        except AuthenticationFailed as exc:
            self.count("checksum_failures")
            log.warning("%s", exc)
            if not self.read_only:
                self.index.delete_session(rec.session_id, rec.tenant)
            return None
        return replace(rec, token_ids=data, key_id=None)

    def shred_tenant(self, tenant: str) -> ShredReport:
        """Crypto-shred: destroy `tenant`'s data key and session records at once (one
        transaction, secure_delete, WAL checkpointed). Every chunk of the tenant is unreadable
        from then on; `gc` deletes the files. A plain store has no key to destroy: the
        tenant's chunk files and records are deleted now instead."""
        self.check_writable()
        keys = tenant_chunk_keys(self.index, tenant)
        if self.keyring is not None:
            n_keys, n_sessions = self.keyring.shred(tenant)
            return ShredReport(tenant, n_keys, n_sessions, len(keys), True)
        rows = [r for r in (self.index.get_chunk(k) for k in keys) if r is not None]
        self.delete_rows(rows)
        _, n_sessions = shred_records(self.index, tenant)
        return ShredReport(tenant, 0, n_sessions, len(rows), False)

    def delete_session(self, session_id: str, tenant: str) -> bool:
        self.check_writable()
        return self.index.delete_session(session_id, tenant)

    # ---- stats -------------------------------------------------------------------------------

    def stats(self) -> L3Stats:
        chunks, used = self.index.totals()
        if self.max_bytes is not None:
            capacity = self.max_bytes
        else:
            hot = self._layout.dirs["hot"]
            st = os.statvfs(hot if hot.exists() else self.root)
            capacity = st.f_blocks * st.f_frsize
        counts, seconds = self._counters.snapshot()
        return L3Stats(
            capacity_bytes=capacity,
            used_bytes=used,
            chunks=chunks,
            sessions=self.index.session_count(),
            read_seconds=seconds["read_seconds"],
            write_seconds=seconds["write_seconds"],
            **counts,
        )
