"""Crypto-shred: after `shred_tenant`, no token id or KV byte of the tenant can be read anywhere
under the L3 root (raw files, the SQLite index and its WAL included); its sessions recompute
and other tenants restore exactly (docs/security.md)."""

from __future__ import annotations

import json
import os
import sqlite3
from array import array
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_llama
from l3_helpers import FP, header, payload_for
from server_proc import Server

from kvtier import CacheConfig, TieredCache, kvbin, sealing
from kvtier.cli.l3 import command as l3_command
from kvtier.errors import MasterKeyRequired, TenantKeyShredded
from kvtier.integrations.hf import cache_kwarg
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3.keys import tenant_chunk_keys
from kvtier.tiers.l3.maint import gc

CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def master_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def cfg(root: Path, key: Path | None) -> CacheConfig:
    return CacheConfig(
        l3_root=root,
        l1_bytes=8 << 20,
        l2_bytes=4 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,
        pin_memory=False,
        encrypt=key is not None,
        master_key_file=key,
    )


def ids_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


def last_logits(model, ids: torch.Tensor, pkv=None) -> torch.Tensor:
    with torch.no_grad():
        if pkv is None:
            return model(ids).logits[:, -1]
        return model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv}).logits[:, -1]


def turn(model, cache: TieredCache, sid: str, tenant: str, ids: torch.Tensor):
    s = cache.session(sid, tenant=tenant)
    pkv = s.restore(ids)
    got = last_logits(model, ids, pkv)
    s.commit(ids)
    return s, got


def raw_files(root: Path) -> dict[str, bytes]:
    """Every file under the root as bytes: chunk files, quarantine, index, WAL, shm."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def found(root: Path, pattern: bytes) -> list[str]:
    return [name for name, data in raw_files(root).items() if pattern in data]


def run_two_tenants(model, root: Path, key: Path | None):
    """Tenants A and B each hibernate a session to L3; returns the live cache, both prompts,
    and A's known bytes: a run of its token ids and a slice of one of its KV chunks."""
    cache = TieredCache(cfg(root, key), model)
    a_ids, b_ids = ids_of(3 * CHUNK + 5, seed=10), ids_of(3 * CHUNK + 5, seed=11)
    for sid, tenant, ids in (("a1", "A", a_ids), ("b1", "B", b_ids)):
        s, _ = turn(model, cache, sid, tenant, ids)
        s.hibernate()
    cache.flush()
    a_chunk = tenant_chunk_keys(cache.l3.index, "A")[0]
    _, kv = cache.l3.get_bytes(a_chunk, fingerprint=cache.fingerprint)
    kv_bytes = kv[512:576]
    assert len(set(kv_bytes)) > 8  # a distinctive run of KV bytes, not padding
    token_bytes = array("i", a_ids[0, 4:20].tolist()).tobytes()
    return cache, a_ids, b_ids, token_bytes, kv_bytes


def check_after_shred(model, cache: TieredCache, a_ids, b_ids) -> None:
    """A recomputes (in the live cache), B is untouched and restores exactly."""
    assert {s.tenant for s in cache.sessions()} == {"B"}
    a_longer = torch.cat([a_ids, ids_of(3, seed=12)], dim=1)
    s, got = turn(model, cache, "a1", "A", a_longer)
    assert s.restore_source == "recompute" and s.info().tokens == a_longer.shape[1]
    torch.testing.assert_close(got, last_logits(model, a_longer), atol=1e-5, rtol=0)
    b_longer = torch.cat([b_ids, ids_of(3, seed=13)], dim=1)
    s, got = turn(model, cache, "b1", "B", b_longer)
    assert s.restore_source in ("l2", "l3")
    torch.testing.assert_close(got, last_logits(model, b_longer), atol=1e-5, rtol=0)


def test_scan_finds_a_tenants_bytes_in_a_plain_store_and_none_after_its_shred(
    model, tmp_path: Path
) -> None:
    """The scan itself works: in a plain store A's token ids (its record) and KV (its chunk
    files) are there to find; shred deletes them, with no copy left in free pages or the WAL."""
    root = tmp_path / "l3"
    cache, a_ids, b_ids, token_bytes, kv_bytes = run_two_tenants(model, root, None)
    assert found(root, token_bytes) and found(root, kv_bytes)
    report = cache.shred_tenant("A")
    assert (report.encrypted, report.sessions) == (False, 1) and report.chunks >= 3
    assert found(root, token_bytes) == [] and found(root, kv_bytes) == []
    check_after_shred(model, cache, a_ids, b_ids)
    cache.close()


def test_shred_makes_every_byte_of_the_tenant_unreadable(model, tmp_path: Path) -> None:
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    cache, a_ids, b_ids, token_bytes, kv_bytes = run_two_tenants(model, root, key)
    assert found(root, token_bytes) == [] and found(root, kv_bytes) == []  # sealed all along
    l3 = cache.l3
    assert l3.keyring is not None
    data_key = l3.keyring.for_tenant("A")
    db = sqlite3.connect(f"file:{root / 'index.sqlite'}?mode=ro", uri=True)
    (wrapped,) = db.execute("SELECT wrapped FROM tenant_keys WHERE tenant = 'A'").fetchone()
    db.close()
    assert found(root, bytes(wrapped)) and found(root, data_key.secret) == []
    a_chunks = tenant_chunk_keys(l3.index, "A")

    report = cache.shred_tenant("A")

    assert (report.encrypted, report.keys, report.sessions) == (True, 1, 1)
    assert report.chunks == len(a_chunks) >= 3
    with pytest.raises(TenantKeyShredded):  # unreadable at once, files still there
        l3.get_bytes(a_chunks[0], fingerprint=cache.fingerprint)
    assert l3.path(a_chunks[0]).exists()
    # neither the wrapped key nor its record survives in the index, its free pages or the WAL
    assert found(root, bytes(wrapped)) == []
    assert found(root, data_key.secret) == []
    check_after_shred(model, cache, a_ids, b_ids)
    cache.close()

    with L3Store(root) as store:  # gc needs no master key
        done = gc(store)
    # A's recompute above wrote its full chunks again, under its new key; the rest go now
    assert 1 <= done.shredded <= len(a_chunks)
    for f in root.rglob("*.kvbin"):  # no file sealed by the destroyed key is left
        assert kvbin.decode(f.read_bytes()[: kvbin.HEADER_SIZE]).key_id != data_key.key_id
    for pattern in (token_bytes, kv_bytes, bytes(wrapped), data_key.secret):
        assert found(root, pattern) == []

    cache = TieredCache(cfg(root, key), model)  # after a restart: B restores exactly from L3
    b_longer = torch.cat([b_ids, ids_of(5, seed=14)], dim=1)
    s, got = turn(model, cache, "b1", "B", b_longer)
    assert s.restore_source == "l3"
    torch.testing.assert_close(got, last_logits(model, b_longer), atol=1e-5, rtol=0)
    cache.close()


def test_cli_shred_then_gc(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    mk = sealing.MasterKey(os.urandom(32))
    mine, theirs = header(tenant="acme"), header(tenant="globex")
    with L3Store(root, master_key=mk) as store:
        store.put_many([(h, payload_for(h.key, 10_000)) for h in (mine, theirs)])
    runner = CliRunner()
    out = runner.invoke(l3_command, ["stat", "--root", str(root), "--json"])
    assert json.loads(out.output)["master_key_id"] == mk.key_id  # the id, never the key
    out = runner.invoke(
        l3_command, ["shred", "--root", str(root), "--tenant", "acme", "--yes", "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "tenant": "acme",
        "keys": 1,
        "sessions": 0,
        "chunks": 1,
        "encrypted": True,
    }
    out = runner.invoke(l3_command, ["gc", "--root", str(root), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["shredded"] == 1
    with L3Store(root, master_key=mk) as store:
        assert not store.contains(mine.key)
        assert store.get_bytes(theirs.key, fingerprint=FP)[1] == payload_for(theirs.key, 10_000)
    with L3Store(root) as store, pytest.raises(MasterKeyRequired):
        store.get_bytes(theirs.key, fingerprint=FP)  # locked without the master key


# ---- the server ---------------------------------------------------------------------------------

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB", "--chunk-tokens", "16")


def chat(url: str, sid: str, tenant: str, text: str) -> httpx.Response:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"X-Session-ID": sid, "X-Tenant": tenant}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_server_delete_tenant_and_wrong_key_start(tmp_path: Path) -> None:
    key = master_file(tmp_path / "master.key")
    root = tmp_path / "l3"
    enc = ("--encrypt", "--master-key-file", str(key))
    srv = Server(root, *SMALL, *enc).start()
    try:
        text = "tell me about the weather in a long sentence " * 3
        chat(srv.url, "a1", "A", text)
        chat(srv.url, "b1", "B", text)
        r = httpx.delete(srv.url + "/v1/tenants/A")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["deleted"] is True and body["encrypted"] is True and body["keys"] == 1
        listing = httpx.get(srv.url + "/v1/sessions").json()["data"]
        assert {s["tenant"] for s in listing} == {"B"}
        again = chat(srv.url, "a1", "A", text)
        assert again.headers["x-kvtier-restore-source"] == "recompute"
        other = chat(srv.url, "b1", "B", text)
        assert other.headers["x-kvtier-restore-source"] != "recompute"
    finally:
        assert srv.stop() == 0, srv.output()
    wrong = Server(root, *SMALL, "--encrypt", "--master-key-file", str(master_file(tmp_path / "x")))
    with pytest.raises(RuntimeError, match="wrong master key"):
        wrong.start()
    assert any(root.rglob("*.kvbin"))  # nothing deleted
