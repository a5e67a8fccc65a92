"""fsck, migrate and gc on real stores, through the library and the `kvtier l3` CLI."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from l3_helpers import FP, header, payload_for

from kvtier.cli.l3 import command, parse_duration, parse_size
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.tiers.l3.maint import fsck, gc, migrate


def fill(store: L3Store, n: int, size: int = 9000) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        h = header(size=size)
        data = payload_for(h.key, size)
        store.put(h, data)
        out.append((h.key, data))
    return out


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(command, list(args))
    return result.exit_code, result.output


def test_fsck_clean_then_corrupt_then_check_only(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        chunks = fill(store, 4)
    code, out = run("fsck", "--root", str(root), "--json")
    assert code == 0 and json.loads(out)["ok"] == 4
    bad_key = chunks[1][0]
    path = root / "hot" / bad_key.hex()[:2] / f"{bad_key.hex()}.kvbin"
    with open(path, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xff\xff")
    code, out = run("fsck", "--root", str(root), "--check", "--json")
    assert code == 4 and "payload checksum" in json.loads(out)["left"][0]  # problems left
    assert path.exists()  # check-only repairs nothing
    code, out = run("fsck", "--root", str(root))
    assert code == 1 and "quarantined     1" in out
    assert not path.exists() and len(list((root / "quarantine").iterdir())) == 1
    assert run("fsck", "--root", str(root))[0] == 0


def test_fsck_rebuild_from_headers_alone(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        chunks = fill(store, 5)
        originals = {k: store.header(k) for k, _ in chunks}
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
    tmp = root / "hot" / chunks[0][0].hex()[:2] / ".x.1.0.tmp"
    tmp.write_bytes(b"junk")
    code, out = run("fsck", "--root", str(root), "--rebuild", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] == 5 and report["rebuilt"]
    assert not tmp.exists()  # a crashed writer's temp file, swept when the store opened
    with L3Store(root) as store:
        for key, data in chunks:
            assert store.header(key) == originals[key]
            assert store.get_bytes(key, fingerprint=FP)[1] == data


def test_fsck_reindexes_orphans_and_drops_stale_rows(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3") as store:
        (k1, _), (k2, _) = fill(store, 2)
        store.index.delete_chunks([k1])  # file without a row (crash between rename and commit)
        os.unlink(store.path(k2))  # row without a file
        report = fsck(store)
        assert (report.indexed, report.stale_rows, report.exit_code) == (1, 1, 1)
        assert store.contains(k1) and not store.contains(k2)
        store.save_session(SessionRecord("s", "t", FP, b"", (k2,), False, None, 0.0, "idle"))
        report = fsck(store, repair=False)
        assert report.exit_code == 2 and "references missing chunk" in report.left[0]
        report = fsck(store)  # the record is cut before the missing chunk
        assert report.exit_code == 1 and "references missing chunk" in report.sessions_truncated[0]
        assert fsck(store).exit_code == 0


def test_migrate_moves_idle_chunks_to_cold(tmp_path: Path) -> None:
    cold = tmp_path / "elsewhere"
    with L3Store(tmp_path / "l3", cold_dir=cold) as store:
        chunks = fill(store, 3)
        store.get_bytes(chunks[0][0], fingerprint=FP)
        store.flush_touches()
        report = migrate(store, 60, now=time.time() + 3600)
        assert report.chunks == 3
        assert migrate(store, 60, now=time.time() + 3600).chunks == 0
        for key, data in chunks:
            assert store.index.get_chunk(key).tier == "cold"  # type: ignore[union-attr]
            assert not store.path(key, "hot").exists()
            assert store.path(key, "cold").is_relative_to(cold)
            assert store.get_bytes(key, fingerprint=FP)[1] == data
        assert fsck(store).exit_code == 0
    code, out = run("migrate", "--root", str(tmp_path / "l3"), "--older-than", "7d", "--json")
    assert code == 0 and json.loads(out)["chunks"] == 0


def test_gc_ttl_size_cap_and_sessions(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        chunks = fill(store, 6)
        keys = [k for k, _ in chunks]
        store.save_session(SessionRecord("keep", "t", FP, b"", (keys[0],), True, None, 0.0, "idle"))
        store.save_session(SessionRecord("old", "t", FP, b"", (keys[1],), False, 10.0, 0.0, "idle"))
        for k in keys[2:4]:
            store.get_bytes(k, fingerprint=FP)
        store.flush_touches()
        later = time.time() + 100
        # Nothing is older than a day yet; the expired session is dropped, freeing keys[1].
        report = gc(store, older_than_s=86400, now=later)
        assert (report.sessions_expired, report.chunks) == (1, 0)
        # Cap at 3 chunks: the two least recently used unreferenced ones go (keys[1], keys[4]
        # or keys[5], never keys[0] which a pinned session references).
        one = store.header(keys[0]).payload_len  # type: ignore[union-attr]
        cap = 3 * (4096 + -(-one // 4096) * 4096)
        report = gc(store, max_bytes=cap, now=later)
        assert report.chunks == 3 and store.stats().used_bytes <= cap
        assert store.contains(keys[0]) and store.contains(keys[2]) and store.contains(keys[3])
        report = gc(store, older_than_s=0, now=later + 1)
        assert report.chunks == 2 and store.contains(keys[0])
    code, out = run("gc", "--root", str(root), "--older-than", "30d", "--max-bytes", "1G", "--json")
    assert code == 0 and json.loads(out)["chunks"] == 0


def test_ls_and_stat(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        chunks = fill(store, 2)
    code, out = run("ls", "--root", str(root), "--json")
    assert code == 0 and {c["key"] for c in json.loads(out)} == {k.hex() for k, _ in chunks}
    code, out = run("ls", "--root", str(root))
    assert code == 0 and chunks[0][0].hex() in out
    code, out = run("stat", "--root", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["chunks"] == 2 and data["tiers"]["hot"]["chunks"] == 2
    assert "chunks     2" in run("stat", "--root", str(root))[1]
    code, out = run("stat", "--root", str(tmp_path / "missing"))
    assert code == 1 and "does not exist" in out


def test_duration_and_size_parsing() -> None:
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    assert parse_size("2G") == 2 * 10**9 and parse_size("500MiB") == 500 << 20
    with pytest.raises(Exception, match="duration"):
        parse_duration("soon")
