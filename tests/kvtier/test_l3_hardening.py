"""Store hardening: private roots, atomic schema migrations, no index commit on the read path,
and puts under the size cap that do not scan the whole index."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from l3_helpers import FP, header, payload_for

from kvtier import kvbin
from kvtier.errors import UnsafeRootError
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3 import index as l3_index
from kvtier.tiers.l3.index import ChunkRow

SIZE = 4096
ONE = kvbin.file_size(SIZE)


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702])
def test_group_or_world_writable_root_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "l3"
    L3Store(root).close()
    assert (root.stat().st_mode & 0o777) == 0o700  # created private
    os.chmod(root, mode)
    with pytest.raises(UnsafeRootError, match=f"chmod 700 {root}"):
        L3Store(root)
    with pytest.raises(UnsafeRootError, match="writable"):
        L3Store(root, read_only=True)
    os.chmod(root, 0o700)
    os.chmod(root / "hot", 0o775)
    with pytest.raises(UnsafeRootError, match="group-writable"):
        L3Store(root)


def _schema(path: Path) -> tuple[int, set[str]]:
    db = sqlite3.connect(path)
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    finally:
        db.close()
    return version, names


def test_a_failed_first_migration_leaves_no_half_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = l3_index.MIGRATIONS

    def broken(db: sqlite3.Connection) -> None:
        real[0](db)
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(l3_index, "MIGRATIONS", (broken, *real[1:]))
    root = tmp_path / "l3"
    with pytest.raises(sqlite3.OperationalError, match="injected"):
        L3Store(root)
    assert _schema(root / "index.sqlite") == (0, set())
    monkeypatch.setattr(l3_index, "MIGRATIONS", real)
    with L3Store(root) as store:
        assert store.stats().chunks == 0


def test_a_failed_upgrade_leaves_the_old_schema_and_data_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "l3"
    real = l3_index.MIGRATIONS
    with L3Store(root) as store:
        h = header(size=SIZE)
        store.put(h, payload_for(h.key, SIZE))
    db = sqlite3.connect(root / "index.sqlite")  # back to a store of schema version 1
    for name in ("chunks_added", "chunks_removed", "chunks_resized"):
        db.execute(f"DROP TRIGGER {name}")
    db.execute("DROP TABLE meta")
    db.execute("DROP TABLE totals")
    db.execute("DROP TABLE tenant_keys")  # and what schema 3 added
    for table, column in [("chunks", c) for c in ("encryption", "key_id", "nonce", "tag")] + [
        ("sessions", "key_id")
    ]:
        db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    v1 = _schema(root / "index.sqlite")
    assert v1[0] == 1 and "chunks" in v1[1] and "meta" not in v1[1]

    def broken(db: sqlite3.Connection) -> None:
        real[1](db)  # every statement of the step ran...
        raise sqlite3.OperationalError("database or disk is full (injected)")  # ...then this

    monkeypatch.setattr(l3_index, "MIGRATIONS", (real[0], broken, *real[2:]))
    with pytest.raises(sqlite3.OperationalError, match="injected"):
        L3Store(root)
    assert _schema(root / "index.sqlite") == v1
    monkeypatch.setattr(l3_index, "MIGRATIONS", real)
    with L3Store(root) as store:
        assert (store.stats().chunks, store.stats().used_bytes) == (1, ONE)
        assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, SIZE)


def test_reads_never_commit_access_times_on_the_reading_thread(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3") as store:
        headers = [header(size=SIZE) for _ in range(300)]
        for i in range(0, len(headers), 100):
            store.put_many([(h, payload_for(h.key, SIZE)) for h in headers[i : i + 100]])
        committed_on: list[str] = []
        touch = store.index.touch

        def recording_touch(stamps: dict[bytes, float]) -> None:
            committed_on.append(threading.current_thread().name)
            touch(stamps)

        store.index.touch = recording_touch  # type: ignore[method-assign]
        before = time.time()
        for h in headers:
            store.get_bytes(h.key, fingerprint=FP)
        store._pool("touch", 1).submit(lambda: None).result()  # let a queued flush finish
        assert committed_on and threading.current_thread().name not in committed_on
        flushed = [r for r in store.index.iter_chunks() if r.last_access >= before]
        assert len(flushed) >= 256
        store.close()  # the rest is flushed on close
        assert len(committed_on) >= 2


def _progress_steps(store: L3Store) -> int:
    """SQLite VM steps (in thousands) spent by one put that must evict one chunk."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    store.index.db.set_progress_handler(tick, 1000)
    try:
        h = header(size=SIZE)
        store.put(h, payload_for(h.key, SIZE))
    finally:
        store.index.db.set_progress_handler(None, 0)
    return steps[0]


def _full_store(root: Path, n: int) -> L3Store:
    """A store at its cap of n chunks (index rows; the cap only reads the index)."""
    store = L3Store(root, max_bytes=n * ONE)
    for i in range(256):
        (store.dir("hot") / f"{i:02x}").mkdir(mode=0o700, exist_ok=True)
    now = time.time()
    rows = []
    for i in range(n):
        h = header(size=SIZE)
        rows.append(ChunkRow(h, "hot", ONE, now - n + i))
    store.index.put_chunks(rows)
    return store


def test_a_put_at_the_cap_does_work_independent_of_the_index_size(tmp_path: Path) -> None:
    with _full_store(tmp_path / "small", 200) as small, _full_store(tmp_path / "big", 6000) as big:
        evicted: list[bytes] = []
        big.add_evict_listener(evicted.extend)
        oldest = next(big.index.unreferenced_lru()).header.key
        small_steps = min(_progress_steps(small) for _ in range(3))
        big_steps = _progress_steps(big)
        assert evicted == [oldest]
        assert big.stats().evictions == 1 and big.stats().chunks == 6000
        assert big_steps <= 2 * small_steps + 5, (small_steps, big_steps)


def test_a_read_does_not_wait_for_a_commit_on_the_writing_connection(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3") as store:
        h = header(size=SIZE)
        store.put(h, payload_for(h.key, SIZE))
        busy, release = threading.Event(), threading.Event()

        def committing() -> None:  # holds the writing connection as a commit's fsync would
            with store.index.locked():
                busy.set()
                release.wait(10)

        t = threading.Thread(target=committing)
        t.start()
        try:
            busy.wait(10)
            t0 = time.perf_counter()
            assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, SIZE)
            assert time.perf_counter() - t0 < 2
        finally:
            release.set()
            t.join()
