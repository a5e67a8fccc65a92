"""Forged chunk headers in L3 and L4 (issue 40): a value whose header is self-consistent (its
checksums recomputed) but does not describe the chunk the reader asked for is never used.

Every tier's reader compares the whole header with the chunk it expects (key, model
fingerprint, tokens, geometry, element type, codec and its params, payload length, tenant)
before a byte of it is used; a mismatch is quarantined (an L3 file moved to `quarantine/`, an
L4 value deleted), counted (`checksum_failures`; L3 `format_errors`, L4 `errors`) and the
prefix is recomputed from there. The end-to-end case is the reported attack: an L4 value cut
to half its tokens, served padded with another tenant's KV left in the reused L2 slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_l4 import config, greedy
from transformers import DynamicCache

from kvtier import TieredCache, kvbin
from kvtier.errors import FingerprintMismatch, KvbinFormatError
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l4 import codec, keys

CHUNK = 16
Forgery = Callable[[ChunkHeader, bytes], tuple[ChunkHeader, bytes]]


def _fewer_tokens(h: ChunkHeader, payload: bytes) -> tuple[ChunkHeader, bytes]:
    """Half the tokens and the payload of that many (the reported forgery)."""
    per_token = len(payload) // h.tokens
    tokens = h.tokens // 2
    cut = payload[: per_token * tokens]
    return replace(h, tokens=tokens, payload_len=len(cut)), cut


# each forgery changes one field of the header (and the payload only where its length must
# follow); the value stays self-consistent: both checksums are recomputed
FORGERIES: dict[str, Forgery] = {
    "key": lambda h, p: (replace(h, key=bytes(reversed(h.key))), p),
    "fingerprint": lambda h, p: (replace(h, fingerprint=bytes(16)), p),
    "tokens": _fewer_tokens,
    "payload_len": lambda h, p: (replace(h, payload_len=len(p) // 2), p[: len(p) // 2]),
    "layers": lambda h, p: (replace(h, layers=h.layers + 1), p),
    "kv_heads": lambda h, p: (replace(h, kv_heads=h.kv_heads * 2), p),
    "head_dim": lambda h, p: (replace(h, head_dim=h.head_dim // 2), p),
    "dtype": lambda h, p: (replace(h, dtype="bfloat16"), p),
    "codec": lambda h, p: (replace(h, codec="int8"), p),
    "codec_params": lambda h, p: (replace(h, codec_params=b"\xff\xff\xff"), p),
    "tenant": lambda h, p: (replace(h, tenant="mallory"), p),
}


def forge(value: bytes, field: str) -> tuple[ChunkHeader, bytes]:
    """A chunk's .kvbin bytes (header + payload, padded or not) with `field` forged: the new
    header (its checksums recomputed) and the payload to store after it."""
    h = kvbin.decode(value[:HEADER_SIZE])
    payload = value[HEADER_SIZE : HEADER_SIZE + h.payload_len]
    new, payload = FORGERIES[field](h, payload)
    assert new != h
    return new, payload


def encoded(h: ChunkHeader, payload: bytes) -> bytes:
    return kvbin.encode(h, kvbin.checksum(h.checksum, payload))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def turn(model, cache: TieredCache, sid: str, ids: torch.Tensor, tenant: str):
    """One greedy turn, checked against a full recompute: (sequence, source, tokens restored)."""
    s = cache.session(sid, tenant=tenant)
    pkv = s.restore(ids)
    restored = pkv.get_seq_length()
    seq, scores = greedy(model, ids, pkv)
    s.commit(seq)
    ref_seq, ref_scores = greedy(model, ids, DynamicCache())
    assert torch.equal(seq, ref_seq), "tokens differ from a full recompute"
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    return seq, s.restore_source, restored


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([[(i * 7 + seed * 13) % 250 + 1 for i in range(n)]])


def more(seq: torch.Tensor) -> torch.Tensor:
    return torch.cat([seq, torch.tensor([[3, 4]])], dim=1)


def keys_of(cache: TieredCache, sid: str, tenant: str) -> list[bytes]:
    s = cache.session(sid, tenant=tenant)
    return [*s.chunk_keys] + ([s.tail_key] if s.tail_key else [])


# -- L3 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", sorted(FORGERIES))
def test_l3_forged_header_is_quarantined_and_recomputed(tmp_path: Path, model, field: str) -> None:
    root = tmp_path / "l3"
    with TieredCache(config(root), model) as a:
        seq, _, _ = turn(model, a, "s1", prompt(40), "alpha")
        a.session("s1", tenant="alpha").hibernate()
        first = keys_of(a, "s1", "alpha")[0]
        path = a.l3.path(first)
    h, payload = forge(path.read_bytes(), field)
    path.write_bytes(
        encoded(h, payload) + payload + bytes(kvbin.padded(len(payload)) - len(payload))
    )
    with TieredCache(config(root), model) as b:
        _, src, restored = turn(model, b, "s1", more(seq), "alpha")
        assert (src, restored) == ("recompute", 0)  # nothing of the forged chunk was used
        st = b.l3.stats()
        if field == "fingerprint":  # another model's chunk: left where it is, never used
            assert st.fingerprint_mismatches == 1 and st.quarantined == 0
        else:
            assert st.format_errors == 1 and st.quarantined == 1
            assert b.stats().checksum_failures == 1
            assert len(list((root / "quarantine").iterdir())) == 1
    if field != "fingerprint":
        # the recomputed chunk was written again in its place: the real one (its L3 write is
        # asynchronous; closing the cache above waited for it)
        again = kvbin.decode(path.read_bytes()[:HEADER_SIZE])
        assert (again.key, again.tokens, again.tenant) == (first, CHUNK, "alpha")


# -- L4 ------------------------------------------------------------------------------------------


def _redis(url: str):
    import redis

    return redis.Redis.from_url(url)


def _forge_in_redis(r, key: bytes, field: str) -> None:
    name = keys.chunk(key)
    ttl = r.pttl(name)
    h, payload = forge(r.get(name), field)
    r.set(name, encoded(h, payload) + payload, px=ttl if ttl > 0 else None)


@pytest.mark.parametrize("field", sorted(FORGERIES))
def test_l4_forged_header_is_deleted_and_recomputed(
    tmp_path: Path, model, redis_server, field: str
) -> None:
    url = redis_server.url
    with TieredCache(config(tmp_path / "a", url), model) as a:
        seq, _, _ = turn(model, a, "s1", prompt(40), "alpha")
        a.session("s1", tenant="alpha").hibernate()
        assert a.l4 is not None and a.l4.wait_idle(30)
        first = keys_of(a, "s1", "alpha")[0]
    r = _redis(url)
    _forge_in_redis(r, first, field)
    with TieredCache(config(tmp_path / "b", url), model) as b:
        _, src, restored = turn(model, b, "s1", more(seq), "alpha")
        assert (src, restored) == ("recompute", 0)
        snap = b.stats()
        assert snap.l4 is not None and snap.l4["errors"] == 1
        # another model's value is a FingerprintMismatch, not a corrupt one
        assert snap.checksum_failures == (0 if field == "fingerprint" else 1)
        assert not r.exists(keys.chunk(first))  # deleted: never served again


def test_l4_value_of_the_wrong_shape_is_never_padded_with_another_tenants_kv(
    tmp_path: Path, model, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    """The reported attack, end to end: alpha's session is hibernated to L4, every chunk value
    of it is rewritten to half its tokens (half the payload, checksums recomputed); a fresh
    host serves tenant victim, whose chunks fill its L2 slots, then resumes alpha. Every
    forged value is refused before its payload lands (counted, deleted from Redis), alpha's
    turn recomputes and is exact, and what alpha's chunks hold afterwards, in L3, is alpha's KV
    and nothing of victim's."""
    url = redis_server.url
    slots = 8
    slot_bytes = 2 * 2 * CHUNK * 2 * 16 * 4  # layers, K/V, tokens, kv heads, head dim, float32
    a = TieredCache(config(tmp_path / "a", url), model)
    b = TieredCache(config(tmp_path / "b", url, l2_bytes=slots * slot_bytes), model)
    try:
        assert b.l2.n_slots == slots
        seq, _, _ = turn(model, a, "s1", prompt(70), "alpha")
        a.session("s1", tenant="alpha").hibernate()
        assert a.l4 is not None and a.l4.wait_idle(30)
        alpha = keys_of(a, "s1", "alpha")
        assert len(alpha) == 5  # 4 full chunks and a tail of 10 tokens
        original = {k: a.l3.get_bytes(k, fingerprint=a.fingerprint)[1] for k in alpha}
        r = _redis(url)
        for k in alpha:
            _forge_in_redis(r, k, "tokens")
            forged = kvbin.decode(r.getrange(keys.chunk(k), 0, HEADER_SIZE - 1))
            assert forged.tokens <= CHUNK // 2  # self-consistent: its checksums verify

        turn(model, b, "v1", prompt(slots * CHUNK + 8, seed=5), "victim")
        b.engine.flush()  # victim's chunks are durable in L3: their L2 slots may be reused
        victim = {b.l2.buffer(i).tobytes() for i in range(slots)}
        assert len(victim) == slots and bytes(slot_bytes) not in victim  # every slot victim's
        halves = {v[len(v) // 2 :] for v in victim}

        with caplog.at_level(logging.WARNING, logger="kvtier"):
            _, src, restored = turn(model, b, "s1", more(seq), "alpha")
        # before the fix: `l4`, 74 tokens, the second half of every chunk victim's
        assert (src, restored) == ("recompute", 0)
        snap = b.stats()
        assert snap.l4 is not None and snap.l4["errors"] == len(alpha)
        assert snap.checksum_failures == len(alpha)
        assert snap.tier("l4").hits == 0
        assert not any(r.exists(keys.chunk(k)) for k in alpha)  # deleted: never served again
        warned = " ".join(rec.getMessage() for rec in caplog.records)
        assert all(k.hex() in warned for k in alpha)

        # alpha's recomputed chunks reach L3 again: alpha's KV, no byte of victim's
        b.session("s1", tenant="alpha").hibernate()
        b.engine.flush()
        for k in alpha[:4]:
            h, got = b.l3.get_bytes(k, fingerprint=b.fingerprint)
            assert h.tokens == CHUNK and h.tenant == "alpha"
            assert got[len(got) // 2 :] not in halves
            want = torch.frombuffer(bytearray(original[k]), dtype=torch.float32)
            have = torch.frombuffer(bytearray(got), dtype=torch.float32)
            torch.testing.assert_close(have, want, atol=1e-4, rtol=0)
    finally:
        a.close()
        b.close()


# -- the store readers, field by field -----------------------------------------------------------


def test_l4_codec_refuses_a_value_that_is_not_the_chunk_asked_for() -> None:
    fp = bytes(range(16))
    h = ChunkHeader(
        key=bytes(range(16, 32)), parent=bytes(16), fingerprint=fp, tenant="alpha", tokens=CHUNK,
        layers=2, kv_heads=2, head_dim=16, dtype="float32", codec="native",
        codec_params=b"\x01\x00\x00", payload_len=slot_bytes_of(CHUNK), created=1.0,
    )  # fmt: skip
    payload = bytes(range(256)) * (h.payload_len // 256)
    value = codec.pack_chunk(h, payload)
    got, view = codec.unpack_chunk(value, h.key, fp, ("alpha",), expect=h)
    assert got.tokens == CHUNK and bytes(view) == payload
    for field in sorted(FORGERIES):
        fh, fp_payload = forge(value, field)
        bad = encoded(fh, fp_payload) + fp_payload
        error = FingerprintMismatch if field == "fingerprint" else KvbinFormatError
        with pytest.raises(error):
            codec.unpack_chunk(bad, h.key, fp, ("alpha", "mallory"), expect=h)


def slot_bytes_of(tokens: int) -> int:
    return 2 * 2 * tokens * 2 * 16 * 4
