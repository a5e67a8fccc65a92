"""L3Store on real files: round trips, corruption handling, page-cache routing, sessions,
read-only access, permissions and the size cap."""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from l3_helpers import FP, OTHER_FP, header, payload_for

from kvtier import kvbin
from kvtier.errors import (
    ChecksumMismatch,
    ChunkNotFound,
    FingerprintMismatch,
    KvbinFormatError,
    StoreError,
    StoreFullError,
    UnsafeRootError,
    UnsupportedVersion,
)
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.index import SCHEMA_VERSION


@pytest.fixture
def store(tmp_path: Path):
    s = L3Store(tmp_path / "l3")
    yield s
    s.close()


def put_one(store: L3Store, size: int = 10_000, **over: Any) -> tuple[bytes, bytes]:
    h = header(size=size, **over)
    data = payload_for(h.key, size)
    store.put(h, data)
    return h.key, data


@pytest.mark.parametrize("algo", kvbin.CHECKSUMS)
def test_round_trip_every_field(tmp_path: Path, algo: str) -> None:
    with L3Store(tmp_path / "l3", checksum=algo) as store:
        h = header(
            size=57344 + 5,
            parent=os.urandom(16),
            tenant="tenant/../ü",
            tokens=3,
            layers=28,
            kv_heads=4,
            head_dim=128,
            dtype="float32",
            codec="fp8",
            codec_params=b"\x00\x01scales",
            created=1234.5,
        )
        data = np.frombuffer(payload_for(h.key, h.payload_len), dtype=np.uint8).copy()
        written = store.put(h, data)
        assert written.checksum == algo
        out = store.aligned_buffer(kvbin.padded(h.payload_len))
        got = store.get(h.key, out, fingerprint=FP)
        assert got == written
        for name in ("key", "parent", "fingerprint", "tenant", "tokens", "layers", "kv_heads"):
            assert getattr(got, name) == getattr(h, name)
        assert (got.head_dim, got.dtype, got.codec, got.codec_params) == (
            128,
            "float32",
            "fp8",
            b"\x00\x01scales",
        )
        assert (got.payload_len, got.created, got.compression) == (57349, 1234.5, "none")
        assert bytes(out[: h.payload_len]) == data.tobytes()
        assert store.header(h.key) == written
        assert store.contains(h.key)
        path = store.path(h.key)
        assert path.stat().st_size == 4096 + kvbin.padded(57349)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_put_many_and_get_bytes(store: L3Store) -> None:
    items = [(header(size=s), None) for s in (1, 4096, 4097, 100_000)]
    batch = [(h, payload_for(h.key, h.payload_len)) for h, _ in items]
    store.put_many(batch)
    for h, data in batch:
        meta, got = store.get_bytes(h.key, fingerprint=FP)
        assert got == data and meta.payload_len == len(data)
    st = store.stats()
    assert (st.chunks, st.writes, st.reads) == (4, 4, 4)
    assert st.used_bytes == sum(kvbin.file_size(len(d)) for _, d in batch)


def test_missing_chunk_and_small_buffer(store: L3Store) -> None:
    with pytest.raises(ChunkNotFound):
        store.get_bytes(os.urandom(16), fingerprint=FP)
    key, _ = put_one(store, size=5000)
    with pytest.raises(ValueError, match="needs 8192"):
        store.get(key, store.aligned_buffer(4096), fingerprint=FP)
    assert store.stats().misses == 1


def test_payload_length_must_match(store: L3Store) -> None:
    h = header(size=10)
    with pytest.raises(KvbinFormatError, match="payload_len=10"):
        store.put(h, b"x" * 11)
    assert not store.contains(h.key)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _corrupt_header_field(path: Path, fmt: str, offset: int, value: object) -> None:
    """Rewrite a header field and its checksum, so only the field check can catch it."""
    with open(path, "r+b") as f:
        hdr = bytearray(f.read(4096))
        struct.pack_into(fmt, hdr, offset, value)
        struct.pack_into("<I", hdr, 4092, kvbin.checksum("crc32c", bytes(hdr[:4092])))
        f.seek(0)
        f.write(hdr)


CORRUPTIONS = {
    "bit flip in header": (lambda p: _flip(p, 40), ChecksumMismatch, "header checksum"),
    "bit flip in payload": (lambda p: _flip(p, 4096 + 777), ChecksumMismatch, "payload checksum"),
    "truncated": (lambda p: os.truncate(p, 4096 + 4096), KvbinFormatError, "does not match"),
    "zero length": (lambda p: os.truncate(p, 0), KvbinFormatError, "file size 0"),
    "wrong magic": (
        lambda p: _corrupt_header_field(p, "<8s", 0, b"GARBAGE!"),
        KvbinFormatError,
        "magic",
    ),
    "future version": (
        lambda p: _corrupt_header_field(p, "<H", 8, 3),
        UnsupportedVersion,
        "version 3",
    ),
    "payload length lies": (
        lambda p: _corrupt_header_field(p, "<Q", 96, 5),
        KvbinFormatError,
        "payload_len 5",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_is_typed_counted_and_quarantined(store: L3Store, case: str) -> None:
    damage, error, message = CORRUPTIONS[case]
    key, _ = put_one(store, size=20_000)
    good_key, good = put_one(store, size=20_000)
    path = store.path(key)
    damage(path)
    out = store.aligned_buffer(kvbin.padded(20_000))
    with pytest.raises(error, match=message) as info:
        store.get(key, out, fingerprint=FP)
    assert "quarantined to" in str(info.value)
    assert not path.exists()
    quarantined = list((store.root / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(key.hex())
    assert not store.contains(key)
    st = store.stats()
    assert st.quarantined == 1
    assert st.checksum_failures + st.format_errors == 1
    assert st.checksum_failures == (1 if error is ChecksumMismatch else 0)
    # A miss from now on, and the store keeps serving other chunks.
    with pytest.raises(ChunkNotFound):
        store.get(key, out, fingerprint=FP)
    assert store.get_bytes(good_key, fingerprint=FP)[1] == good


def test_other_fingerprint_is_refused_but_kept(store: L3Store) -> None:
    key, data = put_one(store)
    with pytest.raises(FingerprintMismatch, match="never used for this model"):
        store.get_bytes(key, fingerprint=OTHER_FP)
    assert store.contains(key) and store.path(key).exists()
    st = store.stats()
    assert (st.fingerprint_mismatches, st.quarantined) == (1, 0)
    assert store.get_bytes(key, fingerprint=FP)[1] == data


def test_misplaced_file_is_detected(store: L3Store) -> None:
    key_a, _ = put_one(store)
    key_b, _ = put_one(store)
    os.replace(store.path(key_a), store.path(key_b))  # b's name now holds a's bytes
    with pytest.raises(KvbinFormatError, match=f"holds chunk {key_a.hex()}"):
        store.get_bytes(key_b, fingerprint=FP)


def _direct_supported(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return l3_io.set_direct(fd, True)
    finally:
        os.close(fd)


def test_page_cache_policy_and_read_routes(tmp_path: Path) -> None:
    with L3Store(tmp_path / "drop") as store:
        key, data = put_one(store, size=1 << 20)
        path = store.path(key)
        if not _direct_supported(path):
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert l3_io.cached_pages(fd, path.stat().st_size) == 0  # dropped after the write
        finally:
            os.close(fd)
        assert store.get_bytes(key, fingerprint=FP)[1] == data
        assert (store.stats().reads_direct, store.stats().reads_cached) == (1, 0)
        # An unaligned caller buffer cannot take O_DIRECT: read buffered, still verified.
        out = bytearray(kvbin.padded(len(data)) + 1)
        store.get(key, memoryview(out)[1:], fingerprint=FP)
        assert bytes(out[1 : 1 + len(data)]) == data
        assert store.stats().reads_buffered == 1
    with L3Store(tmp_path / "keep", keep_page_cache=True) as store:
        key, data = put_one(store, size=1 << 20)
        assert store.get_bytes(key, fingerprint=FP)[1] == data
        assert (store.stats().reads_direct, store.stats().reads_cached) == (0, 1)


def test_cached_pages_mincore_fallback_agrees(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert l3_io.mincore_pages(fd, 65536) == l3_io.cached_pages(fd, 65536) == 16
        os.fsync(fd)  # only clean pages can be dropped
        l3_io.drop_cache(fd)
        assert l3_io.mincore_pages(fd, 65536) == l3_io.cached_pages(fd, 65536) == 0
    finally:
        os.close(fd)


def test_tmpfs_store_works(tmp_path: Path) -> None:
    # tmpfs refuses O_DIRECT before Linux 6.6 (EINVAL) and accepts it since; either way reads work.
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm tmpfs on this machine")
    root = Path(os.path.join(shm, f"kvtier-test-{os.getpid()}"))
    try:
        with L3Store(root) as store:
            key, data = put_one(store, size=100_000)
            fd = os.open(store.path(key), os.O_RDONLY)
            try:
                direct = l3_io.set_direct(fd, True)
            finally:
                os.close(fd)
            assert store.get_bytes(key, fingerprint=FP)[1] == data
            st = store.stats()
            assert st.reads == 1 and (direct or st.reads_direct == 0)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_buffered_when_direct_io_is_off(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3", direct_io=False) as store:
        key, data = put_one(store, size=100_000)
        assert store.get_bytes(key, fingerprint=FP)[1] == data
        assert (store.stats().reads_buffered, store.stats().reads_direct) == (1, 0)


def test_sessions_round_trip_with_hostile_ids(store: L3Store) -> None:
    keys = (os.urandom(16), os.urandom(16))
    weird = ["../../etc/passwd", "a/b\\c", "\x00nul", "x" * 10_000, "ünï 🙂", ""]
    for i, sid in enumerate(weird):
        rec = SessionRecord(
            session_id=sid,
            tenant=weird[-1 - i],
            fingerprint=FP,
            token_ids=np.arange(i * 10, dtype="<i4").tobytes(),
            chunk_keys=keys[: i % 3],
            pinned=bool(i % 2),
            ttl_s=None if i % 2 else 60.0,
            last_active=1000.0 + i,
            state="hibernated",
        )
        store.save_session(rec)
        assert store.load_session(sid, weird[-1 - i]) == rec
    assert len(store.list_sessions()) == len(weird)
    # Same id, another tenant: a different session.
    assert store.load_session(weird[0], "someone-else") is None
    # Replacing keeps one row.
    rec = store.list_sessions()[0]
    store.save_session(SessionRecord(**{**rec.__dict__, "state": "idle"}))
    assert store.load_session(rec.session_id, rec.tenant).state == "idle"  # type: ignore[union-attr]
    assert len(store.list_sessions()) == len(weird)
    assert store.delete_session(rec.session_id, rec.tenant)
    assert store.load_session(rec.session_id, rec.tenant) is None
    # Nothing but the store's own layout exists on disk.
    names = {p.name for p in store.root.iterdir()}
    assert names <= {
        "hot",
        "cold",
        "quarantine",
        "index.sqlite",
        "index.sqlite-wal",
        "index.sqlite-shm",
        ".lock",
    }
    with pytest.raises(ValueError, match="state"):
        store.save_session(SessionRecord(**{**rec.__dict__, "state": "bogus"}))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_read_only_never_writes(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as w:
        key, data = put_one(w)
        bad, _ = put_one(w)
    _flip(root / "hot" / bad.hex()[:2] / f"{bad.hex()}.kvbin", 4096 + 1)
    before = _tree(root)
    with L3Store(root, read_only=True) as r:
        assert r.get_bytes(key, fingerprint=FP)[1] == data
        with pytest.raises(ChecksumMismatch, match="read-only"):
            r.get_bytes(bad, fingerprint=FP)
        with pytest.raises(StoreError, match="read_only"):
            r.put(header(), b"")
        assert r.stats().chunks == 2
    assert _tree(root) == before


def test_read_only_process_alongside_a_writer(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as w:
        key, data = put_one(w)
        code = (
            "import sys; from kvtier.tiers.l3 import L3Store\n"
            f"s = L3Store({str(root)!r}, read_only=True)\n"
            f"h, d = s.get_bytes(bytes.fromhex({key.hex()!r}), fingerprint={FP!r})\n"
            "print(len(d), s.stats().chunks)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert out.stdout.split() == [str(len(data)), "1"]
        put_one(w)  # the writer is not blocked by the reader having been there
        assert w.stats().chunks == 2


def test_second_writer_is_refused(store: L3Store) -> None:
    with pytest.raises(StoreError, match="open for writing"):
        L3Store(store.root)


def test_permissions_and_unsafe_roots(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    L3Store(root).close()
    for d in (root, root / "hot", root / "cold", root / "quarantine"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "index.sqlite").stat().st_mode) == 0o600
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeRootError, match="chmod 700"):
        L3Store(root)
    os.chmod(root, 0o700)
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafeRootError, match="chown"):
        L3Store(root)


def test_size_cap_evicts_unreferenced_lru(tmp_path: Path) -> None:
    one = kvbin.file_size(8192)
    with L3Store(tmp_path / "l3", max_bytes=3 * one) as store:
        keys = [put_one(store, size=8192)[0] for _ in range(3)]
        store.get_bytes(keys[0], fingerprint=FP)  # keys[0] is now the most recently used
        store.flush_touches()
        store.save_session(
            SessionRecord("s", "t", FP, b"", (keys[1],), False, None, 0.0, "hibernated")
        )
        k4, _ = put_one(store, size=8192)
        assert [store.contains(k) for k in (*keys, k4)] == [True, True, False, True]
        assert store.stats().evictions == 1
        for k in (keys[0], k4):
            store.save_session(
                SessionRecord(k.hex(), "t", FP, b"", (k,), True, None, 0.0, "hibernated")
            )
        with pytest.raises(StoreFullError, match="referenced by sessions"):
            put_one(store, size=8192)
        assert store.stats().chunks == 3


def test_files_are_the_truth_when_the_index_is_lost(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        key, data = put_one(store)
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
    with L3Store(root) as store:
        assert not store.contains(key)
        assert store.get_bytes(key, fingerprint=FP)[1] == data  # found on disk, re-indexed
        assert store.contains(key)


def test_leftover_temp_files_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        key, _ = put_one(store)
    tmp = store.path(key).parent / ".dead.123.0.tmp"
    tmp.write_bytes(b"partial")
    L3Store(root).close()
    assert not tmp.exists()


def test_schema_version_and_newer_index_refused(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    L3Store(root).close()
    db = sqlite3.connect(root / "index.sqlite")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this"):
        L3Store(root)


def test_close_is_idempotent(tmp_path: Path) -> None:
    store = L3Store(tmp_path / "l3")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get_bytes(os.urandom(16), fingerprint=FP)
