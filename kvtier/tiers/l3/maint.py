"""Maintenance of an L3 store: fsck (verify every file, repair the index), hot->cold migration
and garbage collection (TTL of unreferenced chunks, size cap by LRU).

Each function takes an open, writable `L3Store` (fsck also runs read-only, repairing nothing) and
an optional `progress(done, total)` callback so that the CLI can draw a progress bar.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtier import kvbin
from kvtier.errors import KvbinFormatError, StoreError
from kvtier.kvbin import HEADER_SIZE
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.index import ChunkRow
from kvtier.tiers.l3.keys import shredded_chunks
from kvtier.tiers.l3.layout import subdirs
from kvtier.tiers.l3.store import TIERS, L3Store

Progress = Callable[[int, int], None]


EXIT_CODES = (
    (0, "clean: nothing to repair"),
    (
        1,
        "problems found and all repaired (damaged chunks quarantined, index and session "
        "records fixed); the next run exits 0",
    ),
    (2, "problems left: found with --check, or not repairable (unexpected files); see LEFT"),
)


@dataclass
class FsckReport:
    """What fsck found. `exit_code`: see EXIT_CODES (0 clean, 1 all repaired, 2 some left)."""

    files: int = 0
    ok: int = 0
    quarantined: list[str] = field(default_factory=list)  # "key: reason"
    indexed: int = 0  # good files that had no index row and got one
    stale_rows: int = 0  # index rows whose file was missing, removed
    temp_removed: int = 0
    sessions_truncated: list[str] = field(default_factory=list)  # "session: kept n of m chunks"
    totals_fixed: bool = False
    rebuilt: bool = False
    left: list[str] = field(default_factory=list)  # problems not repaired

    @property
    def repaired(self) -> int:
        return (
            len(self.quarantined)
            + self.indexed
            + self.stale_rows
            + self.temp_removed
            + len(self.sessions_truncated)
            + self.totals_fixed
        )

    @property
    def exit_code(self) -> int:
        if self.left:
            return 2
        return 1 if self.repaired else 0


def _files(store: L3Store) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for tier in TIERS:
        for sub in subdirs(store.dir(tier)):
            out.extend((tier, sub / name) for name in sorted(os.listdir(sub)))
    return out


def verify_file(path: Path) -> kvbin.ChunkHeader:
    """Read a whole .kvbin file and check it: header, name, size and payload checksum."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise KvbinFormatError(f"file has {size} bytes, less than a header")
        hdr = l3_io.aligned_buffer(HEADER_SIZE)
        l3_io.read_into(fd, [hdr], 0)
        header = kvbin.decode(hdr)
        if path.name != f"{header.key.hex()}.kvbin":
            raise KvbinFormatError(f"file holds chunk {header.key.hex()}, not the one it names")
        if kvbin.file_size(header.payload_len) != size:
            raise KvbinFormatError(f"payload_len {header.payload_len} does not match size {size}")
        body = l3_io.aligned_buffer(size - HEADER_SIZE)
        if l3_io.read_into(fd, [body], HEADER_SIZE) != size - HEADER_SIZE:
            raise KvbinFormatError("short read (truncated file)")
        kvbin.verify_payload(header, body[: header.payload_len])
        return header
    finally:
        os.close(fd)


def fsck(
    store: L3Store, *, rebuild: bool = False, repair: bool = True, progress: Progress | None = None
) -> FsckReport:
    """Verify every chunk file against its header and reconcile the index with the files."""
    repair = repair and not store.read_only
    if rebuild and not repair:
        raise StoreError("fsck --rebuild needs a writable store (drop --check / read-only)")
    report = FsckReport(rebuilt=rebuild)
    if rebuild:
        store.index.clear_chunks()
    indexed = {r.header.key: r for r in store.index.iter_chunks()}
    seen: set[bytes] = set()
    files = _files(store)
    new_rows: list[ChunkRow] = []
    for done, (tier, path) in enumerate(files, 1):
        if progress:
            progress(done, len(files))
        name = path.name
        if name.endswith(".tmp"):
            if repair:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                report.temp_removed += 1
            else:
                report.left.append(f"temp file {path}")
            continue
        if not name.endswith(".kvbin"):
            continue
        report.files += 1
        try:
            key = bytes.fromhex(path.stem)
            if len(key) != kvbin.KEY_SIZE:
                raise ValueError
        except ValueError:
            report.left.append(f"unexpected file {path}")
            continue
        try:
            header = verify_file(path)
        except (KvbinFormatError, OSError) as exc:
            reason = f"{path.stem}: {exc}"
            if repair:
                store.quarantine(key, path)
                report.quarantined.append(reason)
            else:
                report.left.append(reason)
            continue
        report.ok += 1
        seen.add(key)
        row = indexed.get(key)
        if row is None or row.tier != tier:
            if repair:
                new_rows.append(
                    ChunkRow(header, tier, path.stat().st_size, row.last_access if row else 0.0)
                )
                if not rebuild:
                    report.indexed += 1
            else:
                report.left.append(f"{path.stem}: file not in the index")
    if new_rows:
        store.index.put_chunks(new_rows)
    stale = [k for k in indexed if k not in seen]
    if stale:
        if repair:
            store.index.delete_chunks(stale)
            report.stale_rows += len(stale)
        else:
            report.left.extend(f"{k.hex()}: indexed but no file" for k in stale)
    if repair:
        report.totals_fixed = store.index.recount()
    _check_sessions(store, report, repair)
    return report


def _check_sessions(store: L3Store, report: FsckReport, repair: bool) -> None:
    """A session whose record names a chunk that is gone keeps the prefix before it: its chunk
    keys and token ids are cut at the first missing chunk (the rest is recomputed on restore)."""
    dangling = {(sid, tenant) for sid, tenant, _ in store.index.dangling_references()}
    for session_id, tenant in sorted(dangling):
        rec = store.index.load_session(session_id, tenant)
        if rec is None:
            continue
        name = f"session {session_id[:40]!r} (tenant {tenant[:40]!r})"
        if rec.key_id is not None:  # sealed token ids: cut only with the master key
            if store.keyring is None or store.keyring.locked:
                report.left.append(f"{name} references a missing chunk; its record is sealed: "
                                   "run `kvtier l3 fsck --master-key-file PATH` to cut it")  # fmt: skip
                continue
            rec = store.load_session(session_id, tenant)
            if rec is None:
                continue
        kept, tokens = 0, 0
        for key in rec.chunk_keys:
            row = store.index.get_chunk(key)
            if row is None:
                break
            kept, tokens = kept + 1, tokens + row.header.tokens
        tokens = min(tokens, len(rec.token_ids) // 4)
        what = (
            f"{name} references missing chunk {rec.chunk_keys[kept].hex()}: keeps its first "
            f"{kept} of {len(rec.chunk_keys)} chunks ({tokens} tokens)"
        )
        if not repair:
            report.left.append(what)
            continue
        store.save_session(  # sealed again in an encrypted store
            replace(rec, chunk_keys=rec.chunk_keys[:kept], token_ids=rec.token_ids[: 4 * tokens])
        )
        report.sessions_truncated.append(what)


@dataclass
class MoveReport:
    chunks: int = 0
    bytes: int = 0


def migrate(
    store: L3Store,
    older_than_s: float,
    *,
    now: float | None = None,
    progress: Progress | None = None,
) -> MoveReport:
    """Move chunks not used for `older_than_s` from hot to cold: copy, fsync, rename, then unlink
    (cold may be another filesystem). A crash leaves the chunk in hot, cold, or both, never none."""
    store.check_writable()
    store.record_cold_root()  # from now on reads and later runs look for them there
    store.flush_touches()
    cutoff = (time.time() if now is None else now) - older_than_s
    rows = [r for r in store.index.iter_chunks() if r.tier == "hot" and r.last_access < cutoff]
    report = MoveReport()
    for done, row in enumerate(rows, 1):
        if progress:
            progress(done, len(rows))
        src = store.path(row.header.key, "hot")
        dst = store.path(row.header.key, "cold")
        dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = dst.parent / f".{dst.stem}.{os.getpid()}.migrate.tmp"
        try:
            _copy_durable(src, tmp)
        except FileNotFoundError:
            continue
        os.rename(tmp, dst)
        l3_io.fsync_dir(dst.parent)
        store.index.set_tier(row.header.key, "cold")
        os.unlink(src)
        l3_io.fsync_dir(src.parent)
        report.chunks += 1
        report.bytes += row.size
    return report


def _copy_durable(src: Path, dst: Path) -> None:
    fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fin).st_size
            sent = 0
            while sent < size:
                n = (
                    os.copy_file_range(fin, fout, size - sent)
                    if hasattr(os, "copy_file_range")
                    else 0
                )
                if n <= 0:
                    n = os.sendfile(fout, fin, sent, size - sent)
                    if n <= 0:
                        raise OSError(f"copy of {src} stopped at {sent} of {size} bytes")
                sent += n
            os.fdatasync(fout)
            l3_io.drop_cache(fout)
        except BaseException:
            os.close(fout)
            with contextlib.suppress(OSError):
                os.unlink(dst)
            raise
        os.close(fout)
    finally:
        os.close(fin)


@dataclass
class GcReport:
    sessions_expired: int = 0
    chunks: int = 0
    bytes: int = 0
    shredded: int = 0  # of `chunks`: sealed by a destroyed data key (kvtier l3 shred)


def gc(
    store: L3Store,
    *,
    older_than_s: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Drop expired unpinned sessions, then delete chunks that no session references: those unused
    for `older_than_s`, then the least recently used until the store fits `max_bytes`. Chunks
    whose data key was destroyed (crypto-shred) are deleted first, whatever their age."""
    store.check_writable()
    store.flush_touches()
    now = time.time() if now is None else now
    report = GcReport()
    for session_id, tenant in store.index.expired_sessions(now):
        store.index.delete_session(session_id, tenant)
        report.sessions_expired += 1
    victims: dict[bytes, ChunkRow] = {r.header.key: r for r in shredded_chunks(store.index)}
    report.shredded = len(victims)
    if older_than_s is not None:
        for row in store.index.unreferenced_lru(older_than=now - older_than_s):
            victims[row.header.key] = row
    if max_bytes is not None:
        _, used = store.index.totals()
        used -= sum(r.size for r in victims.values())
        for row in store.index.unreferenced_lru():
            if used <= max_bytes:
                break
            if row.header.key not in victims:
                victims[row.header.key] = row
                used -= row.size
    rows = list(victims.values())
    for start in range(0, len(rows), 256):
        batch = rows[start : start + 256]
        store.delete_rows(batch)
        store.notify_evicted([r.header.key for r in batch])
        if progress:
            progress(start + len(batch), len(rows))
    report.chunks = len(rows)
    report.bytes = sum(r.size for r in rows)
    store.count("evictions", len(rows))
    return report
