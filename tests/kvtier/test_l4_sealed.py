"""L4 with encryption at rest: chunk values and session records in Redis are sealed as L3
seals them, hosts sharing the master key open each other's values, a tampered value is
recomputed, and a crypto-shred reaches L4.

Every test runs a real redis-server (tests/kvtier/redis_server.py) and real TieredCaches with
separate L3 roots sharing one master key file; the model is a tiny Llama with random weights.
"""

from __future__ import annotations

import base64
import os
from array import array
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from l3_helpers import FP, header, payload_for
from redis_server import RedisServer, need_redis
from test_l4 import config, hibernate_to_l4, prompt, turn

from kvtier import TieredCache, kvbin, sealing
from kvtier.errors import ChunkNotFound, KvbinFormatError
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.tiers.l4 import L4Store, codec, keys, wire
from kvtier.tiers.l4.sealed import KEY_MAGIC, TenantKeys


@pytest.fixture
def redis_server(tmp_path: Path):
    need_redis()
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def master(tmp_path: Path) -> Path:
    path = tmp_path / "master.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def sealed_config(root: Path, url: str, master: Path, **kw):
    return config(root, url, encrypt=True, master_key_file=master, **kw)


def redis_values(r) -> dict[bytes, list[bytes]]:
    """Every key in Redis with the bytes it holds (a string's value, a hash's fields and
    values): what anyone who can read the Redis sees."""
    out: dict[bytes, list[bytes]] = {}
    for name in r.scan_iter(match=b"*", count=1000):
        kind = r.type(name)
        if kind == b"string":
            out[name] = [r.get(name)]
        elif kind == b"hash":
            out[name] = [b for kv in r.hgetall(name).items() for b in kv]
        else:  # pragma: no cover - kvtier writes strings and hashes only
            raise AssertionError(f"unexpected Redis type {kind!r} of {name!r}")
    return out


def test_l4_holds_no_plaintext_and_another_host_restores_exactly(
    tmp_path: Path, model, redis_server: RedisServer, master: Path
) -> None:
    a = TieredCache(sealed_config(tmp_path / "a", redis_server.url, master), model)
    b = TieredCache(sealed_config(tmp_path / "b", redis_server.url, master), model)
    try:
        seq, src, _ = turn(model, a, "s1", prompt(70), tenant="t1")
        assert src == "recompute"
        hibernate_to_l4(a, "s1", tenant="t1")
        s = a.session("s1", tenant="t1")
        tokens = array("i", s.tokens).tobytes()
        _, kv = a.l3.get_bytes(s.chunk_keys[0], fingerprint=a.fingerprint)
        pattern = kv[1024:1088]
        assert len(set(pattern)) > 8  # real KV bytes, not padding
        ring = a.l3.keyring
        assert ring is not None
        data_key = ring.for_tenant("t1").secret

        values = redis_values(redis_server.client())
        fp = a.fingerprint
        assert keys.record(fp, "t1", "s1").encode() in values
        needles = {
            "token ids": tokens[:64],
            "token ids (base64)": base64.b64encode(tokens)[:64],
            "KV bytes": pattern,
            "data key": data_key,
        }
        for name, blobs in values.items():
            for blob in blobs:
                for what, needle in needles.items():
                    assert needle not in blob, f"{what} readable in Redis key {name!r}"
        chunks = [v[0] for n, v in values.items() if n.startswith(b"kvtier:c:")]
        assert len(chunks) == 5  # 4 full chunks + the tail
        for value in chunks:  # v2 headers: sealed exactly as L3 seals
            h = kvbin.decode(value[:HEADER_SIZE])
            assert h.sealed and h.tenant == "t1" and h.key_id == ring.for_tenant("t1").key_id
        assert keys.tenant_keys("t1").encode() in values
        wrapped = values[keys.tenant_keys("t1").encode()]
        assert wrapped[1].startswith(KEY_MAGIC)

        # host B (same master key, its own L3) restores the session exactly from L4
        ids = torch.cat([seq, torch.tensor([[3, 4, 5]])], dim=1)
        _, src, restored = turn(model, b, "s1", ids, tenant="t1")
        assert src == "l4" and restored == 74
        snap = b.stats()
        assert snap.l4 is not None
        assert snap.l4["hits"] == 5 and snap.l4["errors"] == 0
    finally:
        a.close()
        b.close()


def test_a_tampered_sealed_value_is_recomputed(
    tmp_path: Path, model, redis_server: RedisServer, master: Path
) -> None:
    """A payload byte changed and the value's checksum made to match (what anyone who can
    write to Redis can do): the AES-GCM tag refuses it; the value is deleted, counted and
    the session recomputes."""
    a = TieredCache(sealed_config(tmp_path / "a", redis_server.url, master), model)
    b = TieredCache(sealed_config(tmp_path / "b", redis_server.url, master), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(70), tenant="t1")
        hibernate_to_l4(a, "s1", tenant="t1")
        first = a.session("s1", tenant="t1").chunk_keys[0]
        r = redis_server.client()
        name = keys.chunk(first)
        value = bytearray(r.get(name))
        value[HEADER_SIZE + 5000] ^= 0xFF
        h = kvbin.decode(bytes(value[:HEADER_SIZE]))
        crc = kvbin.checksum(h.checksum, memoryview(value)[HEADER_SIZE:])
        value[:HEADER_SIZE] = kvbin.encode(h, crc)
        r.set(name, bytes(value))
        ids = torch.cat([seq, torch.tensor([[3]])], dim=1)
        _, src, restored = turn(model, b, "s1", ids, tenant="t1")
        assert src == "recompute" and restored == 0
        snap = b.stats()
        assert snap.l4 is not None
        assert snap.l4["errors"] == 1 and snap.checksum_failures >= 1
        assert not r.exists(name)  # never served again
    finally:
        a.close()
        b.close()


def test_shred_reaches_l4(tmp_path: Path, model, redis_server: RedisServer, master: Path) -> None:
    """After `shred_tenant` on host A, no host restores the tenant from L4, even from values
    put back after the shred (they are sealed under the destroyed key); another tenant still
    restores exactly."""
    url = redis_server.url
    r = redis_server.client()
    with TieredCache(sealed_config(tmp_path / "a", url, master), model) as a:
        fp = a.fingerprint
        seq1, _, _ = turn(model, a, "s1", prompt(70), tenant="t1")
        hibernate_to_l4(a, "s1", tenant="t1")
        seq2, _, _ = turn(model, a, "s2", prompt(50, seed=3), tenant="t2")
        hibernate_to_l4(a, "s2", tenant="t2")
        t1_chunks = [  # every chunk of t1 in Redis, the tail among them
            n
            for n in r.scan_iter(match=b"kvtier:c:*")
            if kvbin.decode(r.getrange(n, 0, HEADER_SIZE - 1)).tenant == "t1"
        ]
        assert len(t1_chunks) == 5
        left = {n: r.dump(n) for n in [keys.record(fp, "t1", "s1").encode(), *t1_chunks]}
        report = a.shred_tenant("t1")
        assert report.encrypted
        # the tenant's keys, record and chunks are gone from Redis; t2's are not
        assert not r.exists(keys.tenant_keys("t1"), *left)
        assert r.exists(keys.tenant_keys("t2"), keys.record(fp, "t2", "s2")) == 2

    # values of t1 put back after the shred (a copy made before, a delete that did not
    # happen) name a data key nobody has any more: a miss on every host
    for name, dumped in left.items():
        r.restore(name, 0, dumped, replace=True)
    with TieredCache(sealed_config(tmp_path / "b", url, master), model) as b:
        ids = torch.cat([seq1, torch.tensor([[3, 4]])], dim=1)
        _, src, restored = turn(model, b, "s1", ids, tenant="t1")
        assert src == "recompute" and restored == 0
        ids = torch.cat([seq2, torch.tensor([[7]])], dim=1)
        _, src, restored = turn(model, b, "s2", ids, tenant="t2")
        assert src == "l4" and restored == seq2.shape[1] - 1


# ---- the store, with real L3 keyrings ---------------------------------------------------------

BIG = 300_000 + 1000  # many socket reads, and a last piece that is not a multiple of 16


def sealed_l4(url: str, l3: L3Store, mk: sealing.MasterKey) -> L4Store:
    store = L4Store(url)
    assert l3.keyring is not None
    store.sealer = TenantKeys(store, l3.keyring, mk)
    return store


def read_one(store: L4Store, key: bytes, size: int) -> tuple[ChunkHeader, bytes]:
    buf = bytearray(size + 4096)
    fut = store.get_chunks([key], FP, lambda i, h: memoryview(buf)).futures[0]
    h = fut.result(10)
    return h, bytes(buf[: h.payload_len])


def test_l3_chunks_are_sealed_again_and_open_on_another_host(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk read back from a sealed L3 (a v2 header, the payload opened) goes to L4 sealed
    again under a fresh nonce; a host with the same master key and its own L3 opens it on
    the fast path (decrypted in place, piece by piece), hosts that cannot open it miss
    without deleting it, and an encrypted host never serves a plain value."""
    monkeypatch.setattr(wire, "PIECE", 4096)
    mk, other_mk = sealing.MasterKey(os.urandom(32)), sealing.MasterKey(os.urandom(32))
    url, r = redis_server.url, redis_server.client()
    h = header(size=BIG, tenant="acme")
    data = payload_for(h.key, BIG)
    with (
        L3Store(tmp_path / "a", master_key=mk) as l3a,
        L3Store(tmp_path / "b", master_key=mk) as l3b,
        L3Store(tmp_path / "d", master_key=other_mk) as l3d,
    ):
        l3a.put(h, data)
        from_l3, plain = l3a.get_bytes(h.key, fingerprint=FP)
        assert from_l3.sealed and plain == data
        a, b = sealed_l4(url, l3a, mk), sealed_l4(url, l3b, mk)
        d = sealed_l4(url, l3d, other_mk)
        c = L4Store(url)  # a host without encryption
        try:
            a.put_chunk(from_l3, plain)
            value = r.get(keys.chunk(h.key))
            stored = kvbin.decode(value[:HEADER_SIZE])
            assert stored.sealed and stored.key_id == from_l3.key_id
            assert stored.nonce != from_l3.nonce and data[:256] not in value
            got, payload = read_one(b, h.key, BIG)
            assert got.sealed and payload == data
            for other in (c, d):  # no key, another master key: a miss, the value stays
                with pytest.raises(ChunkNotFound):
                    read_one(other, h.key, BIG)
                assert r.exists(keys.chunk(h.key))
            # a plain value (a host without encryption wrote it): refused and deleted
            c.put_chunk(header(key=h.key, size=BIG, tenant="acme"), data)
            with pytest.raises(KvbinFormatError):
                read_one(b, h.key, BIG)
            assert not r.exists(keys.chunk(h.key))
        finally:
            for s in (a, b, c, d):
                s.close()


def test_session_records_are_sealed_in_l4(tmp_path: Path, redis_server: RedisServer) -> None:
    mk = sealing.MasterKey(os.urandom(32))
    url, r = redis_server.url, redis_server.client()
    toks = array("i", range(1000, 1400)).tobytes()
    rec = SessionRecord("s1", "acme", FP, toks, (bytes(16),), False, None, 1.0, "hibernated")
    name = keys.record(FP, "acme", "s1")
    with (
        L3Store(tmp_path / "a", master_key=mk) as l3a,
        L3Store(tmp_path / "b", master_key=mk) as l3b,
    ):
        a, b, c = sealed_l4(url, l3a, mk), sealed_l4(url, l3b, mk), L4Store(url)
        try:
            a.put_record(rec)
            value = r.get(name)
            assert toks[:64] not in value and base64.b64encode(toks)[:64] not in value
            back = b.get_record(FP, "acme", "s1")
            assert back is not None and back.token_ids == toks and back.key_id is None
            assert c.get_record(FP, "acme", "s1") is None and r.exists(name)  # no key: a miss
            # its sealed token ids altered and the record's checksum made to match: the tag
            # refuses it, and it is deleted
            stored = codec.unpack_record(value)
            flipped = bytearray(stored.token_ids)
            flipped[20] ^= 1
            r.set(name, codec.pack_record(replace(stored, token_ids=bytes(flipped))))
            assert b.get_record(FP, "acme", "s1") is None
            assert not r.exists(name) and b.stats()["errors"] == 1
        finally:
            for s in (a, b, c):
                s.close()
