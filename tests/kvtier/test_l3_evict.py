"""Chunks the L3 store deletes on its own (size cap, gc) are reported to evict listeners, and a
read of a chunk that is gone raises the typed ChunkNotFound, so a cache above can forget it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from l3_helpers import FP, header, payload_for

from kvtier import kvbin
from kvtier.errors import ChunkNotFound
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.tiers.l3.maint import gc

SIZE = 8192
ONE = kvbin.file_size(SIZE)


def put(store: L3Store) -> bytes:
    h = header(size=SIZE)
    store.put(h, payload_for(h.key, SIZE))
    return h.key


def test_size_cap_reports_evicted_keys_outside_the_store_locks(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3", max_bytes=3 * ONE) as store:
        seen: list[list[bytes]] = []
        locks_free: list[bool] = []

        def listener(keys: list[bytes]) -> None:
            # Outside the store's locks: another thread can take them, and calling back
            # into the store works.
            locks_free.append(store._lock.acquire(blocking=False))
            if locks_free[-1]:
                store._lock.release()
            free = store._room_lock.acquire(blocking=False)
            if free:
                store._room_lock.release()
            locks_free.append(free)
            for k in keys:
                assert not store.contains(k)
            seen.append(keys)

        store.add_evict_listener(listener)
        keys = [put(store) for _ in range(3)]
        assert seen == []
        k4 = put(store)
        assert seen == [[keys[0]]]
        assert all(locks_free)
        assert store.contains(k4)
        with pytest.raises(ChunkNotFound):
            store.get_bytes(keys[0], fingerprint=FP)
        assert store.stats().evictions == 1


def test_a_failing_listener_is_logged_and_never_breaks_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with L3Store(tmp_path / "l3", max_bytes=2 * ONE) as store:
        later: list[list[bytes]] = []

        def broken(keys: list[bytes]) -> None:
            raise RuntimeError("listener bug")

        store.add_evict_listener(broken)
        store.add_evict_listener(later.append)
        first = put(store)
        put(store)
        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.l3"):
            k3 = put(store)  # evicts `first`; the broken listener raises
        assert "listener" in caplog.text
        assert later == [[first]]  # the next listener still ran
        assert store.get_bytes(k3, fingerprint=FP)[1] == payload_for(k3, SIZE)
        put(store)  # and the store keeps working
        assert len(later) == 2


def test_gc_reports_the_chunks_it_deletes(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3") as store:
        seen: list[bytes] = []
        store.add_evict_listener(seen.extend)
        keys = [put(store) for _ in range(4)]
        store.save_session(
            SessionRecord("s", "t", FP, b"", (keys[1],), True, None, 0.0, "hibernated")
        )
        report = gc(store, older_than_s=0, now=2e10)
        assert report.chunks == 3
        assert sorted(seen) == sorted(k for k in keys if k != keys[1])
        assert store.stats().evictions == 3  # counted for the snapshot's L3 evictions
        # A delete the caller asked for is not reported.
        store.delete(keys[1])
        assert len(seen) == 3


def test_listener_of_concurrent_puts_sees_every_eviction_once(tmp_path: Path) -> None:
    with L3Store(tmp_path / "l3", max_bytes=4 * ONE) as store:
        seen: list[bytes] = []
        guard = threading.Lock()

        def listener(keys: list[bytes]) -> None:
            with guard:
                seen.extend(keys)

        store.add_evict_listener(listener)
        written: list[bytes] = []

        def worker() -> None:
            for _ in range(6):
                k = put(store)
                with guard:
                    written.append(k)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(seen) == len(set(seen)) == store.stats().evictions
        live = {r.header.key for r in store.index.iter_chunks()}
        assert live | set(seen) == set(written)
        assert not live & set(seen)


@pytest.mark.parametrize("how", ["file", "index_and_file"])
def test_read_of_a_missing_chunk_raises_chunk_not_found(tmp_path: Path, how: str) -> None:
    with L3Store(tmp_path / "l3") as store:
        key = put(store)
        store.path(key).unlink()
        if how == "index_and_file":
            store.index.delete_chunks([key])
        out = store.aligned_buffer(kvbin.padded(SIZE))
        with pytest.raises(ChunkNotFound, match="not in L3"):
            store.get(key, out, fingerprint=FP)
        with pytest.raises(ChunkNotFound):
            store.get_bytes(key, fingerprint=FP)
        assert not store.contains(key)
        assert store.stats().misses == 2
