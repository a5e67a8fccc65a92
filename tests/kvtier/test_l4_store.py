"""kvtier.tiers.l4 on its own: the breaker, the key layout, the value codec and L4Store
against a real redis-server (tests/kvtier/redis_server.py)."""

from __future__ import annotations

import os
import time
from array import array
from pathlib import Path

import pytest
from redis_server import RedisServer, need_redis

from kvtier import kvbin
from kvtier.errors import (
    ChecksumMismatch,
    ChunkNotFound,
    ConfigError,
    FingerprintMismatch,
    KvbinFormatError,
    L4Unavailable,
)
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3 import SessionRecord
from kvtier.tiers.l4 import Breaker, L4Store, codec, keys
from kvtier.tiers.l4.breaker import CLOSED, HALF_OPEN, OPEN

FP = bytes(range(16))


def header(key: bytes, n: int, tenant: str = "t") -> ChunkHeader:
    return ChunkHeader(
        key=key,
        parent=bytes(16),
        fingerprint=FP,
        tenant=tenant,
        tokens=16,
        layers=2,
        kv_heads=2,
        head_dim=16,
        dtype="float32",
        codec="native",
        codec_params=b"",
        payload_len=n,
        created=time.time(),
    )


def record(sid: str = "s", tenant: str = "t") -> SessionRecord:
    return SessionRecord(
        sid,
        tenant,
        FP,
        array("i", [1, 2, 3]).tobytes(),
        (b"k" * 16,),
        False,
        None,
        1.0,
        "hibernated",
    )


@pytest.fixture
def redis_server(tmp_path: Path):
    need_redis()
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


# -- the breaker (a pure object; its clock is a variable here) ---------------------------------


def test_breaker_opens_backs_off_probes_and_closes() -> None:
    now = [0.0]
    b = Breaker(threshold=2, backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    assert b.allow() and b.state == CLOSED
    b.failure()
    assert b.state == CLOSED  # one timeout is not an outage
    b.failure()
    assert b.state == OPEN and not b.allow()
    now[0] = 1.0
    assert b.allow() and b.state == HALF_OPEN  # the probe
    assert not b.allow()  # only one probe at a time
    b.failure()  # the probe failed: open again, backoff doubled
    assert b.state == OPEN
    now[0] = 2.5
    assert not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()
    b.trip()  # connection refused: open at once
    assert b.state == OPEN and b.opened == 3


def test_a_probe_that_ends_in_another_error_still_settles_the_breaker() -> None:
    """A call that raised something neither a timeout, a refusal nor a Redis reply: a closed
    breaker counts nothing, a probe opens it again (it would refuse every call after it)."""
    now = [0.0]
    b = Breaker(threshold=2, backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    b.probe_failed()
    assert b.state == CLOSED and b.failures == 0
    b.trip()
    now[0] = 1.0
    assert b.allow() and b.state == HALF_OPEN
    b.probe_failed()
    assert b.state == OPEN and not b.allow()
    now[0] = 3.0  # the backoff doubled
    assert b.allow() and b.state == HALF_OPEN


# -- keys and values ----------------------------------------------------------------------------


def test_keys_carry_cluster_hash_tags_shared_with_their_temp_keys() -> None:
    k = bytes(range(16))
    final = keys.chunk(k)
    assert final == f"kvtier:c:{{{k.hex()}}}"
    tmp = keys.temp(final)

    def tag(name: str) -> str:
        return name[name.index("{") + 1 : name.index("}")]

    assert tag(tmp) == tag(final) and tmp != final
    assert keys.record(FP, "a", "s") != keys.record(FP, "b", "s")  # tenants never share
    assert keys.record(FP, "a", "s") != keys.record(bytes(16), "a", "s")  # nor models
    assert keys.record(FP, "ab", "c") != keys.record(FP, "a", "bc")


def test_redact_removes_the_password() -> None:
    assert keys.redact("redis://:pw@h:6379/0") == "redis://h:6379/0"
    assert keys.redact("redis://user:pw@[::1]:6379/2") == "redis://[::1]:6379/2"
    assert keys.redact("redis://h:6379/0") == "redis://h:6379/0"


def test_chunk_values_are_verified() -> None:
    k = os.urandom(16)
    payload = os.urandom(10000)
    value = codec.pack_chunk(header(k, len(payload)), payload)
    h, got = codec.unpack_chunk(value, k, FP, ("t",))
    assert bytes(got) == payload and h.tenant == "t"
    bad = bytearray(value)
    bad[kvbin.HEADER_SIZE + 10] ^= 1
    with pytest.raises(ChecksumMismatch):
        codec.unpack_chunk(bytes(bad), k, FP)
    with pytest.raises(KvbinFormatError, match="truncated"):
        codec.unpack_chunk(value[:-1], k, FP)
    with pytest.raises(KvbinFormatError, match="not"):
        codec.unpack_chunk(value, os.urandom(16), FP)
    with pytest.raises(FingerprintMismatch):
        codec.unpack_chunk(value, k, bytes(16))
    with pytest.raises(KvbinFormatError, match="another tenant"):
        codec.unpack_chunk(value, k, FP, ("u", "kvtier#shared"))


def test_records_round_trip_and_damage_is_detected() -> None:
    rec = record()
    assert codec.unpack_record(codec.pack_record(rec)) == rec
    value = bytearray(codec.pack_record(rec))
    value[-3] ^= 1
    with pytest.raises(KvbinFormatError):
        codec.unpack_record(bytes(value))
    with pytest.raises(KvbinFormatError):
        codec.unpack_record(b"nonsense")


# -- the store against redis-server ---------------------------------------------------------


def test_put_get_miss_and_records(redis_server) -> None:
    store = L4Store(redis_server.url, ttl_s=60)
    try:
        k = os.urandom(16)
        payload = os.urandom(3 << 20)
        store.put_chunk(header(k, len(payload)), payload)
        r = redis_server.client()
        assert 0 < r.pttl(keys.chunk(k)) <= 60_000  # chunks get a TTL
        assert r.keys("*tmp*") == []  # the temp key was renamed away
        buf = bytearray(len(payload))
        missing = os.urandom(16)
        batch = store.get_chunks([k, missing], FP, lambda i, h: memoryview(buf), tenants=("t",))
        assert batch.futures[0].result(10).key == k and buf == payload
        with pytest.raises(ChunkNotFound):
            batch.futures[1].result(10)
        assert store.exists([k, missing]) == [True, False]
        store.put_record(record())
        assert store.get_record(FP, "t", "s") == record()
        assert store.get_record(FP, "u", "s") is None
        store.delete_record(FP, "t", "s")
        assert store.get_record(FP, "t", "s") is None
        st = store.stats()
        assert (st["hits"], st["misses"], st["errors"], st["put_count"]) == (1, 1, 0, 1)
        assert st["bytes_read"] == st["bytes_written"] == len(payload) + kvbin.HEADER_SIZE
    finally:
        store.close()


def test_a_dead_server_opens_the_breaker_and_a_new_one_closes_it(redis_server) -> None:
    store = L4Store(redis_server.url, breaker=Breaker(backoff_s=0.2))
    try:
        store.ping()
        redis_server.kill()
        with pytest.raises(L4Unavailable):
            store.get_record(FP, "t", "s")
        assert store.stats()["breaker"] == OPEN and not store.stats()["up"]
        with pytest.raises(L4Unavailable, match="breaker is open"):
            store.get_record(FP, "t", "s")  # refused at once, no connection tried
        redis_server.start()
        time.sleep(0.25)
        assert store.get_record(FP, "t", "s") is None  # the half-open probe succeeds
        assert store.stats()["breaker"] == CLOSED and store.stats()["up"]
    finally:
        store.close()


def test_a_bad_url_is_a_config_error() -> None:
    pytest.importorskip("redis")
    with pytest.raises(ConfigError, match="redis://host:port/db"):
        L4Store("http://nowhere")
    from kvtier import CacheConfig

    with pytest.raises(ConfigError, match="l4_url"):
        CacheConfig(l3_root="x", l4_url="localhost:6379")


def test_a_pipeline_stays_in_step_past_bad_values(redis_server) -> None:
    """Reads land straight in their buffers; a damaged, short, foreign, missing or wrong-type
    value fails its own key only, and the replies after it are still read right."""
    store = L4Store(redis_server.url, streams=1)
    r = redis_server.client()
    try:
        ks = [os.urandom(16) for _ in range(7)]
        payloads = [os.urandom(200_000 + i) for i in range(7)]
        for k, p in zip(ks, payloads, strict=True):
            store.put_chunk(header(k, len(p)), p)
        name = keys.chunk(ks[1])
        r.setrange(name, kvbin.HEADER_SIZE + 7, b"\x00\x01")  # damaged payload
        r.set(keys.chunk(ks[2]), b"short")  # truncated
        r.delete(keys.chunk(ks[3]))  # evicted
        r.delete(keys.chunk(ks[4]))
        r.rpush(keys.chunk(ks[4]), b"x")  # not a string
        r.set(keys.chunk(ks[5]), r.get(keys.chunk(ks[6])))  # another chunk's value
        bufs = [bytearray(len(p)) for p in payloads]
        batch = store.get_chunks(ks, FP, lambda i, h: memoryview(bufs[i]), tenants=("t",))
        assert batch.futures[0].result(10).key == ks[0] and bufs[0] == payloads[0]
        with pytest.raises(ChecksumMismatch):
            batch.futures[1].result(10)
        with pytest.raises(KvbinFormatError, match="truncated"):
            batch.futures[2].result(10)
        with pytest.raises(ChunkNotFound):
            batch.futures[3].result(10)
        with pytest.raises(L4Unavailable, match="WRONGTYPE"):
            batch.futures[4].result(10)
        with pytest.raises(KvbinFormatError, match="not"):
            batch.futures[5].result(10)
        assert batch.futures[6].result(10).key == ks[6] and bufs[6] == payloads[6]
        assert not r.exists(name)  # damaged values are deleted
        assert store.stats()["breaker"] == CLOSED
        # the connection is still good for the next read
        again = store.get_chunks([ks[0]], FP, lambda i, h: memoryview(bufs[0]))
        assert again.futures[0].result(10).key == ks[0]
    finally:
        store.close()


def test_exists_renews_the_ttl_of_chunks_it_finds(redis_server) -> None:
    store = L4Store(redis_server.url, ttl_s=60)
    try:
        k = os.urandom(16)
        store.put_chunk(header(k, 100), os.urandom(100))
        r = redis_server.client()
        r.pexpire(keys.chunk(k), 1000)  # about to expire
        assert store.exists([k, os.urandom(16)]) == [True, False]
        assert r.pttl(keys.chunk(k)) > 50_000
    finally:
        store.close()
