"""Encryption at rest: sealed .kvbin v2 chunks and session records, the master key's checks,
and a tag failure handled like a checksum failure (docs/security.md, docs/kvbin-format.md)."""

from __future__ import annotations

import os
import sqlite3
import struct
import subprocess
import sys
import textwrap
from array import array
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from l3_helpers import FP, header, payload_for

from kvtier import CacheConfig, TieredCache, kvbin, sealing
from kvtier.errors import (
    AuthenticationFailed,
    ChecksumMismatch,
    ConfigError,
    EncryptionError,
    KvbinFormatError,
    MasterKeyError,
    MasterKeyRequired,
)
from kvtier.integrations.hf import cache_kwarg
from kvtier.server.config import ServerConfig
from kvtier.tiers.l3 import L3Store

CHUNK = 16
SIZE = 3 * 4096 + 1000  # not a multiple of 4096: the last piece decrypts through scratch


def master_file(path: Path, secret: bytes | None = None, mode: int = 0o600) -> Path:
    path.write_bytes(secret if secret is not None else os.urandom(32))
    path.chmod(mode)
    return path


def all_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# ---- the format -------------------------------------------------------------------------------


def test_sealed_header_is_v2_and_round_trips() -> None:
    h = replace(
        header(size=SIZE),
        encryption="aes-256-gcm",
        key_id=b"k" * 16,
        nonce=b"n" * 12,
        tag=b"t" * 16,
        checksum="crc32",
    )
    raw = kvbin.encode(h, 0x1234)
    assert struct.unpack_from("<H", raw, 8)[0] == kvbin.SEALED_VERSION
    assert raw[432:476] == b"k" * 16 + b"n" * 12 + b"t" * 16
    back = kvbin.decode(raw)
    assert (back.encryption, back.key_id, back.nonce, back.tag) == (
        "aes-256-gcm",
        b"k" * 16,
        b"n" * 12,
        b"t" * 16,
    )
    plain = kvbin.encode(header(size=SIZE, checksum="crc32"), 1)
    assert struct.unpack_from("<H", plain, 8)[0] == 1 and kvbin.decode(plain).encryption == "none"


def _refresh_crc(buf: bytearray) -> bytes:
    algo = kvbin.CHECKSUMS[(struct.unpack_from("<I", buf, 12)[0] >> 12) & 0xF]
    struct.pack_into("<I", buf, 4092, kvbin.checksum(algo, bytes(buf[:4092])))
    return bytes(buf)


def test_version_and_encryption_flag_must_agree() -> None:
    plain = bytearray(kvbin.encode(header(size=SIZE), 1))
    struct.pack_into("<H", plain, 8, 2)  # v2 claims sealed, the flags say plain
    with pytest.raises(KvbinFormatError, match="v1 files are plain"):
        kvbin.decode(_refresh_crc(plain))
    flagged = bytearray(kvbin.encode(header(size=SIZE), 1))
    struct.pack_into("<I", flagged, 12, struct.unpack_from("<I", flagged, 12)[0] | (1 << 8))
    with pytest.raises(KvbinFormatError, match="v1 files are plain"):
        kvbin.decode(_refresh_crc(flagged))


def test_encode_decode_chunk_for_other_tiers() -> None:
    key = sealing.DataKey.new("acme")
    h = header(size=SIZE)
    data = payload_for(h.key, SIZE)
    blob = sealing.encode_chunk(h, data, key)
    assert len(blob) == kvbin.file_size(SIZE) and data[:64] not in blob
    got_h, got = sealing.decode_chunk(blob, chunk_key=h.key, fingerprint=FP, keys=lambda _: key)
    assert got == data and got_h.sealed
    bad = bytearray(blob)
    bad[4096 + 10] ^= 1
    with pytest.raises(ChecksumMismatch):  # the CRC of the ciphertext
        sealing.decode_chunk(bytes(bad), chunk_key=h.key, fingerprint=FP, keys=lambda _: key)
    other = sealing.DataKey(key.key_id, "acme", os.urandom(32))
    with pytest.raises(AuthenticationFailed):
        sealing.decode_chunk(blob, chunk_key=h.key, fingerprint=FP, keys=lambda _: other)


# ---- the store --------------------------------------------------------------------------------


def test_sealed_chunks_round_trip_and_hold_no_plaintext(tmp_path: Path) -> None:
    mk = sealing.MasterKey(os.urandom(32))
    root = tmp_path / "l3"
    headers = [header(size=SIZE, tenant=t) for t in ("acme", "acme", "globex")]
    with L3Store(root, master_key=mk) as store:
        written = store.put_many([(h, payload_for(h.key, SIZE)) for h in headers])
        assert all(w.sealed for w in written)
        assert written[0].key_id == written[1].key_id != written[2].key_id  # one key a tenant
        store.read_piece = 4096  # many pieces: in place, and the last one through scratch
        for h in headers:
            assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, SIZE)
            assert store.header(h.key).sealed  # type: ignore[union-attr]
    for h in headers:
        raw = store.path(h.key).read_bytes()
        assert payload_for(h.key, SIZE)[:256] not in raw
    with L3Store(root, master_key=mk) as store:  # reopened: the wrapped keys unwrap again
        assert store.get_bytes(headers[2].key, fingerprint=FP)[1] == payload_for(
            headers[2].key, SIZE
        )


def test_a_tag_failure_is_quarantined_like_a_checksum_failure(tmp_path: Path) -> None:
    mk = sealing.MasterKey(os.urandom(32))
    root = tmp_path / "l3"
    h = header(size=SIZE)
    with L3Store(root, master_key=mk) as store:
        store.put(h, payload_for(h.key, SIZE))
        path = store.path(h.key)
        data = bytearray(path.read_bytes())
        data[4096 + SIZE - 3] ^= 0x40  # one ciphertext bit
        path.write_bytes(bytes(data))
        with pytest.raises(AuthenticationFailed, match="quarantined"):
            store.get_bytes(h.key, fingerprint=FP)
        assert not path.exists() and store.stats().checksum_failures == 1
        assert len(list((root / "quarantine").iterdir())) == 1


def test_ciphertexts_cannot_be_swapped_between_chunks(tmp_path: Path) -> None:
    """The chunk key is associated data: a sealed payload renamed to another chunk (header
    rewritten to match, checksums recomputed) does not open."""
    mk = sealing.MasterKey(os.urandom(32))
    a, b = header(size=SIZE), header(size=SIZE)
    with L3Store(tmp_path / "l3", master_key=mk) as store:
        store.put_many([(a, payload_for(a.key, SIZE)), (b, payload_for(b.key, SIZE))])
        forged = bytearray(store.path(a.key).read_bytes())
        forged[32:48] = b.key  # the header now names chunk b; its payload is a's
        store.path(b.key).write_bytes(_refresh_crc(forged))
        with pytest.raises(AuthenticationFailed):
            store.get_bytes(b.key, fingerprint=FP)
        assert store.get_bytes(a.key, fingerprint=FP)[1] == payload_for(a.key, SIZE)


def test_a_wrong_or_missing_master_key_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    mk = sealing.MasterKey(os.urandom(32))
    root = tmp_path / "l3"
    h = header(size=SIZE)
    with L3Store(root, master_key=mk) as store:
        store.put(h, payload_for(h.key, SIZE))
    (root / "hot" / "00").mkdir(exist_ok=True)
    (root / "hot" / "00" / ".left.1.1.tmp").write_bytes(b"x")  # a crashed write's temp file
    before = all_files(root)
    with pytest.raises(MasterKeyError, match="wrong master key"):
        L3Store(root, master_key=sealing.MasterKey(os.urandom(32)))
    with pytest.raises(MasterKeyRequired, match="encrypted"):
        L3Store(root, need_key=True)
    after = {k: v for k, v in all_files(root).items() if not k.startswith("index.sqlite")}
    assert after == {k: v for k, v in before.items() if not k.startswith("index.sqlite")}
    with L3Store(root, master_key=mk) as store:
        assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, SIZE)


def test_encryption_is_chosen_when_the_store_is_made(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    h = header(size=SIZE)
    with L3Store(root) as store:
        store.put(h, payload_for(h.key, SIZE))
    with pytest.raises(EncryptionError, match="new --l3-root"):
        L3Store(root, master_key=sealing.MasterKey(os.urandom(32)))


def test_master_key_file_must_be_private_and_well_formed(tmp_path: Path) -> None:
    with pytest.raises(MasterKeyError, match="chmod 600"):
        sealing.load_master_key(master_file(tmp_path / "open.key", mode=0o644))
    with pytest.raises(MasterKeyError, match="32 raw bytes"):
        sealing.load_master_key(master_file(tmp_path / "short.key", b"too short"))
    with pytest.raises(MasterKeyError, match="does not exist"):
        sealing.load_master_key(tmp_path / "missing.key")
    secret = os.urandom(32)
    raw = sealing.load_master_key(master_file(tmp_path / "raw.key", secret))
    hexed = sealing.load_master_key(
        master_file(tmp_path / "hex.key", secret.hex().encode() + b"\n")
    )
    assert raw.key_id == hexed.key_id and secret.hex() not in repr(raw)


# ---- the cache --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def cfg(root: Path, key: Path | None, **kw) -> CacheConfig:
    base = dict(
        l3_root=root,
        l1_bytes=8 << 20,
        l2_bytes=4 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,
        pin_memory=False,
        encrypt=key is not None,
        master_key_file=key,
    )
    base.update(kw)
    return CacheConfig(**base)  # type: ignore[arg-type]


def ids_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


def logits(model, ids: torch.Tensor, pkv=None) -> torch.Tensor:
    with torch.no_grad():
        if pkv is None:
            return model(ids).logits[:, -1]
        start = pkv.get_seq_length()
        return model(ids[:, start:], **{cache_kwarg(model): pkv}).logits[:, -1]


def hibernated(model, config: CacheConfig, ids: torch.Tensor, sid: str = "s", tenant: str = "t"):
    cache = TieredCache(config, model)
    if config.l3_writer != "auto":  # the writer asked for is the one that seals
        assert cache.engine.l3_writer == config.l3_writer
    s = cache.session(sid, tenant=tenant)
    logits(model, ids, s.restore(ids))
    s.commit(ids)
    s.hibernate()
    cache.close()


@pytest.mark.parametrize("writer", ["threads", "process"])
def test_cache_restores_exactly_from_sealed_l3(model, tmp_path: Path, writer: str) -> None:
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    ids = ids_of(3 * CHUNK + 5, seed=1)
    hibernated(model, cfg(root, key, l3_writer=writer), ids)
    files = list((root / "hot").rglob("*.kvbin"))
    assert files and all(kvbin.decode(f.read_bytes()[:4096]).sealed for f in files)
    cache = TieredCache(cfg(root, key, l3_writer=writer), model)
    s = cache.session("s", tenant="t")
    longer = torch.cat([ids, ids_of(4, seed=2)], dim=1)
    pkv = s.restore(longer)
    assert s.restore_source == "l3" and pkv.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(logits(model, longer, pkv), logits(model, longer), atol=1e-5, rtol=0)
    cache.close()


def test_cache_start_with_wrong_key_errors_then_right_key_restores(model, tmp_path: Path) -> None:
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    ids = ids_of(2 * CHUNK + 3, seed=3)
    hibernated(model, cfg(root, key), ids)
    before = {k for k in all_files(root) if not k.startswith("index.sqlite")}
    with pytest.raises(MasterKeyError, match="wrong master key"):
        TieredCache(cfg(root, master_file(tmp_path / "other.key")), model)
    with pytest.raises(MasterKeyRequired, match="encrypted"):
        TieredCache(cfg(root, None), model)
    assert {k for k in all_files(root) if not k.startswith("index.sqlite")} == before
    cache = TieredCache(cfg(root, key), model)
    s = cache.session("s", tenant="t")
    assert list(s.tokens) == ids[0].tolist()  # the sealed record opened
    longer = torch.cat([ids, ids_of(4, seed=5)], dim=1)
    pkv = s.restore(longer)
    assert s.restore_source == "l3" and pkv.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(logits(model, longer, pkv), logits(model, longer), atol=1e-5, rtol=0)
    cache.close()


def test_session_records_are_sealed_and_a_bad_one_is_dropped(model, tmp_path: Path) -> None:
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    ids = ids_of(2 * CHUNK + 7, seed=4)
    hibernated(model, cfg(root, key), ids)
    token_bytes = array("i", ids[0].tolist()).tobytes()
    db = sqlite3.connect(root / "index.sqlite")
    sealed, key_id = db.execute("SELECT token_ids, key_id FROM sessions").fetchone()
    assert key_id is not None and token_bytes[:32] not in bytes(sealed)
    for name, data in all_files(root).items():
        assert token_bytes[:32] not in data, name
    with L3Store(root, read_only=True) as locked:  # no key (kvtop, exporter): sealed, counted
        (rec,) = locked.list_sessions()
        assert rec.key_id is not None and rec.token_count == ids.shape[1]
    flipped = bytearray(sealed)
    flipped[20] ^= 1
    db.execute("UPDATE sessions SET token_ids = ?", (bytes(flipped),))
    db.commit()
    db.close()
    cache = TieredCache(cfg(root, key), model)
    assert cache.sessions() == []  # the altered record failed its tag: dropped, not used
    assert cache.stats().checksum_failures >= 1
    s = cache.session("s", tenant="t")
    pkv = s.restore(ids)
    # its chunks are still there: the prefix restores from L3 by content, never wrong
    torch.testing.assert_close(logits(model, ids, pkv), logits(model, ids), atol=1e-5, rtol=0)
    cache.close()


def test_encrypt_needs_a_master_key_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="master_key_file"):
        cfg(tmp_path / "l3", None, encrypt=True)
    with pytest.raises(ConfigError, match="master_key_file"):
        ServerConfig.load(env={"KVTIER_ENCRYPT": "1"})


def test_server_settings_from_env_and_toml(tmp_path: Path) -> None:
    key = master_file(tmp_path / "master.key")
    env = {"KVTIER_ENCRYPT": "yes", "KVTIER_MASTER_KEY_FILE": str(key)}
    config = ServerConfig.load(env=env)
    assert config.encrypt and config.master_key_file == key
    toml = tmp_path / "kvtier.toml"
    toml.write_text(f'[serve]\nencrypt = true\nmaster_key_file = "{key}"\n')
    config = ServerConfig.load(env={}, file=toml)
    assert config.encrypt and config.master_key_file == key
    assert not ServerConfig.load(env={}, flags={"encrypt": False}).encrypt


def test_a_plain_store_works_where_cryptography_is_missing(tmp_path: Path) -> None:
    """Like the optional crc32c: a host without the package (a bare GPU machine's python3)
    keeps a plain cache; only encryption asks for the package, by name."""
    code = textwrap.dedent(
        """
        import os, sys
        sys.modules["cryptography"] = None  # every import of it now fails
        from kvtier.tiers.l3 import L3Store
        from kvtier.errors import EncryptionError
        from kvtier import sealing
        from l3_helpers import FP, header, payload_for
        h = header(size=5000)
        with L3Store(sys.argv[1] + "/plain") as store:
            store.put(h, payload_for(h.key, 5000))
            assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, 5000)
        try:
            L3Store(sys.argv[1] + "/sealed", master_key=sealing.MasterKey(os.urandom(32))).put(
                h, payload_for(h.key, 5000))
        except EncryptionError as exc:
            assert "pip install" in str(exc), exc
            print("ok")
        """
    )
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("pool", [True, False])
def test_a_large_payload_is_sealed_and_written_in_pieces(tmp_path: Path, pool: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.tiers.l3 import io as l3_io
    from kvtier.tiers.l3.write import SEAL_PIECE, write_chunk_file

    size = 2 * SEAL_PIECE + 5000  # three pieces, the last one short
    h = replace(header(size=size), checksum="crc32")
    data = payload_for(h.key, size)
    key = sealing.DataKey.new(h.tenant)
    src = l3_io.aligned_buffer(size)
    src[:size] = data
    bufs: dict[str, memoryview] = {}

    def buffer(name: str, n: int) -> memoryview:
        if name not in bufs or len(bufs[name]) < n:
            bufs[name] = l3_io.aligned_buffer(n)
        return bufs[name]

    with ThreadPoolExecutor(2) as ex:
        out = write_chunk_file(
            h, src[:size], str(tmp_path / "c.tmp"), direct=True, keep_page_cache=False,
            buffer=buffer, seal=key, pool=ex if pool else None,
        )  # fmt: skip
    assert bytes(src[:size]) == data  # the caller's payload (L2) stays plaintext
    raw = (tmp_path / "c.tmp").read_bytes()
    assert out.sealed and data[:4096] not in raw
    got_h, got = sealing.decode_chunk(raw, chunk_key=h.key, fingerprint=FP, keys=lambda _: key)
    assert got == data and got_h.tag == out.tag
    with L3Store(tmp_path / "l3", master_key=sealing.MasterKey(os.urandom(32))) as store:
        store.put(h, data)
        assert store.get_bytes(h.key, fingerprint=FP)[1] == data


def test_fsck_cuts_a_sealed_record_with_the_master_key(model, tmp_path: Path) -> None:
    """A damaged chunk of an encrypted store: fsck quarantines it; the session record that
    references it is sealed, so without the key fsck reports it (exit 4) and with
    --master-key-file it cuts it (exit 1), after which the store is clean (exit 0). A key file
    others can read is refused with the fix, and nothing changes."""
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    hibernated(model, cfg(root, key), ids_of(3 * CHUNK + 5, seed=6))
    victim = sorted((root / "hot").rglob("*.kvbin"))[1]
    data = bytearray(victim.read_bytes())
    data[-40] ^= 0xFF  # payload damaged: its tag no longer verifies
    victim.write_bytes(bytes(data))

    def fsck(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "ops.cli", "l3", "fsck", "--root", str(root), *extra]
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_MASTER_KEY_FILE"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)

    done = fsck()
    assert done.returncode == 4, done.stdout + done.stderr  # problems left
    assert "--master-key-file" in done.stdout
    loose = master_file(tmp_path / "loose.key", key.read_bytes(), mode=0o644)
    done = fsck("--master-key-file", str(loose))
    assert done.returncode == 8 and "chmod" in done.stderr + done.stdout, done.stderr
    assert "Traceback" not in done.stderr
    done = fsck("--master-key-file", str(key))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "session cut: " in done.stdout
    done = fsck("--master-key-file", str(key))
    assert done.returncode == 0, done.stdout + done.stderr
