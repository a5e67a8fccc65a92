"""The L3 store's throughput machinery keeps every guarantee: reads in overlapping pieces,
writes on a writer pool with the checksum beside the write, and group commit of concurrent puts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from l3_helpers import FP, OTHER_FP, header, payload_for

from kvtier import kvbin
from kvtier.errors import ChecksumMismatch, FingerprintMismatch, KvbinFormatError, StoreError
from kvtier.kvbin import HEADER_SIZE
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3.commit import GroupCommit

PIECE = 8192  # small pieces so that small files take the multi-piece path


@pytest.fixture
def store(tmp_path: Path):
    s = L3Store(tmp_path / "l3", io_threads=3)
    s.read_piece = PIECE
    yield s
    s.close()


@pytest.mark.parametrize("algo", kvbin.CHECKSUMS)
@pytest.mark.parametrize("size", [0, 1, 4096, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 17])
def test_piecewise_read_round_trip(store: L3Store, size: int, algo: str) -> None:
    h = header(size=size, checksum=algo)
    data = payload_for(h.key, size)
    written = store.put(h, data)
    out = store.aligned_buffer(kvbin.padded(size))
    got = store.get(h.key, out, fingerprint=FP)
    assert got == written and bytes(out[:size]) == data
    assert got.payload_crc == kvbin.checksum(algo, data)


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_window_sizes_read_the_same_bytes(store: L3Store, window: int) -> None:
    store.read_window = window
    h = header(size=7 * PIECE + 5)
    data = payload_for(h.key, h.payload_len)
    store.put(h, data)
    assert store.get_bytes(h.key, fingerprint=FP)[1] == data


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["first piece", "middle piece", "last piece", "last byte"])
def test_corrupt_piece_is_detected_and_quarantined(store: L3Store, where: str) -> None:
    size = 6 * PIECE + 100
    h = header(size=size)
    store.put(h, payload_for(h.key, size))
    offset = {
        "first piece": 10,
        "middle piece": 3 * PIECE + 7,
        "last piece": 6 * PIECE + 3,
        "last byte": size - 1,
    }[where]
    path = store.path(h.key)
    _flip(path, HEADER_SIZE + offset)
    with pytest.raises(ChecksumMismatch, match="quarantined"):
        store.get(h.key, store.aligned_buffer(kvbin.padded(size)), fingerprint=FP)
    assert not path.exists() and not store.contains(h.key)
    st = store.stats()
    assert st.checksum_failures == 1 and st.quarantined == 1


def test_corrupt_header_and_other_model_fail_before_use(store: L3Store) -> None:
    a, b = header(size=4 * PIECE), header(size=4 * PIECE, fingerprint=OTHER_FP)
    for h in (a, b):
        store.put(h, payload_for(h.key, h.payload_len))
    _flip(store.path(a.key), 200)
    with pytest.raises(KvbinFormatError, match="header"):
        store.get_bytes(a.key, fingerprint=FP)
    with pytest.raises(FingerprintMismatch):
        store.get_bytes(b.key, fingerprint=FP)
    st = store.stats()
    assert st.checksum_failures + st.format_errors == 1 and st.quarantined == 1
    assert st.fingerprint_mismatches == 1 and st.reads == 0 and store.contains(b.key)


def test_truncated_to_an_aligned_size_is_a_format_error(store: L3Store) -> None:
    h = header(size=6 * PIECE)
    store.put(h, payload_for(h.key, h.payload_len))
    path = store.path(h.key)
    with open(path, "r+b") as f:
        f.truncate(HEADER_SIZE + 3 * PIECE)
    with pytest.raises(KvbinFormatError, match="does not match file size"):
        store.get(h.key, store.aligned_buffer(6 * PIECE), fingerprint=FP)


def test_checksum_beside_the_write_covers_large_payloads(tmp_path: Path) -> None:
    # 2 MiB + 5: at the size where the checksum runs on a worker, unaligned bytes (staged copy)
    # and an aligned buffer (zero-copy) must store the same checksum.
    size = (2 << 20) + 5
    with L3Store(tmp_path / "l3") as store:
        h1 = header(size=size)
        data = payload_for(h1.key, size)
        w1 = store.put(h1, data)
        aligned = store.aligned_buffer(size)
        aligned[:size] = data
        h2 = header(size=size)
        w2 = store.put(h2, aligned[:size])
        assert w1.payload_crc == w2.payload_crc == kvbin.checksum(w1.checksum, data)
        for h in (h1, h2):
            assert store.get_bytes(h.key, fingerprint=FP)[1] == data
        reread = kvbin.decode(store.path(h1.key).read_bytes()[:HEADER_SIZE])
        assert reread.payload_crc == w1.payload_crc


def test_concurrent_puts_share_commits_and_are_durable(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    keys: dict[bytes, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    with L3Store(root) as store:

        def writer(seed: int) -> None:
            try:
                for i in range(12):
                    size = 30_000 + 997 * seed + i
                    h = header(size=size)
                    if i % 3 == 0:
                        more = [header(size=size + 1), header(size=size + 2)]
                        store.put_many([(x, payload_for(x.key, x.payload_len)) for x in [h, *more]])
                        batch = [h, *more]
                    else:
                        store.put(h, payload_for(h.key, size))
                        batch = [h]
                    with lock:  # recorded only after the put returned: durable from here on
                        keys.update((x.key, x.payload_len) for x in batch)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        commit = store._commit
        assert commit.items == 6 * 12 and 1 <= commit.batches <= commit.items
        assert not list(root.rglob("*.tmp"))
    with L3Store(root, read_only=True) as reopened:  # the index rows were committed
        assert reopened.stats().chunks == len(keys) == 6 * (8 + 4 * 3)
        for key, size in keys.items():
            assert reopened.get_bytes(key, fingerprint=FP)[1] == payload_for(key, size)


def test_group_commit_batches_waiters_and_routes_each_error() -> None:
    gate = threading.Event()
    applied: list[list[int]] = []

    def apply(items: list[int]) -> list[BaseException | None]:
        if not applied:
            gate.wait(5)  # hold the first batch so the others queue up behind it
        applied.append(list(items))
        return [ValueError(f"item {i}") if i % 2 else None for i in items]

    commit: GroupCommit[int] = GroupCommit(apply)
    results: dict[int, str] = {}

    def submit(i: int) -> None:
        try:
            commit.submit(i)
            results[i] = "ok"
        except ValueError as exc:
            results[i] = str(exc)

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    while not commit._busy:  # the first submit leads and is held inside apply
        threading.Event().wait(0.001)
    rest = [threading.Thread(target=submit, args=(i,)) for i in range(1, 9)]
    for t in rest:
        t.start()
    while len(commit._pending) < 8:
        threading.Event().wait(0.001)
    gate.set()
    for t in [first, *rest]:
        t.join()
    assert applied[0] == [0]
    assert sorted(i for batch in applied[1:] for i in batch) == list(range(1, 9))
    assert len(applied) == 2  # the eight waiters were committed together
    assert results == {i: ("ok" if i % 2 == 0 else f"item {i}") for i in range(9)}


def test_group_commit_failure_of_apply_fails_the_whole_batch() -> None:
    def apply(items: list[int]) -> list[BaseException | None]:
        raise OSError("disk gone")

    commit: GroupCommit[int] = GroupCommit(apply)
    with pytest.raises(OSError, match="disk gone"):
        commit.submit(1)
    assert commit.batches == 1 and not commit._busy


def test_io_threads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="io_threads"):
        L3Store(tmp_path / "l3", io_threads=0)


def test_write_threads_run_at_background_priority(tmp_path: Path) -> None:
    """L3 writes and their checksums must not take CPU from the thread driving the GPU."""
    import os
    import threading

    from kvtier.tiers.l3 import io as l3_io

    store = L3Store(tmp_path / "l3")
    seen: dict[str, int] = {}

    def nice_of(name: str) -> None:
        seen[name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    store._pool("write").submit(nice_of, "write").result()
    store._pool("crc").submit(nice_of, "crc").result()
    store._pool("read").submit(nice_of, "read").result()
    store.close()
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["write"] == seen["crc"] == max(base, l3_io.BACKGROUND_NICE)
    assert seen["read"] == base
