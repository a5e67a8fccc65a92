"""`kvtier l3 ls` and `stat` text output: the tenant column, unreferenced bytes, counts in words."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from l3_helpers import FP, header, payload_for

from kvtier.cli.l3 import command
from kvtier.humanize import plural, size
from kvtier.tiers.l3 import L3Store, SessionRecord


def run(*args: str) -> str:
    result = CliRunner().invoke(command, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def put(store: L3Store, tenant: str, nbytes: int = 9000) -> bytes:
    h = header(size=nbytes, tenant=tenant)
    store.put(h, payload_for(h.key, nbytes))
    return h.key


def test_ls_text_shows_each_chunks_tenant(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        a = put(store, "acme")
        b = put(store, "globex-research-division")
    out = run("ls", "--root", str(root)).splitlines()
    head = out[0].split()
    assert head[:6] == ["key", "tier", "size", "tokens", "codec", "tenant"]
    # The column lines up: every row's tenant starts where the header's does.
    col = out[0].index("tenant")
    tenants = {line.split()[0]: line[col:].split()[0] for line in out[1:]}
    assert tenants == {a.hex(): "acme", b.hex(): "globex-research-division"}


def test_stat_shows_unreferenced_chunks_and_bytes(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        kept = put(store, "t")
        put(store, "t")
        put(store, "t")
        store.save_session(SessionRecord("s", "t", FP, b"", (kept,), False, None, 0.0, "idle"))
        total = store.stats().used_bytes
        one = store.index.get_chunk(kept).size  # type: ignore[union-attr]
    data = json.loads(run("stat", "--root", str(root), "--json"))
    assert data["unreferenced"] == {"chunks": 2, "bytes": 2 * one}
    assert data["used_bytes"] == total == 3 * one
    text = run("stat", "--root", str(root))
    assert f"unreferenced 2 chunks, {size(2 * one)}" in text
    assert f"hot        3 chunks, {size(3 * one)}" in text


def test_stat_says_one_chunk_not_one_chunks(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    with L3Store(root) as store:
        put(store, "t")
    text = run("stat", "--root", str(root))
    assert "hot        1 chunk," in text and "unreferenced 1 chunk," in text
    assert "1 chunks" not in text


def test_plural_and_size() -> None:
    assert [plural(n, "chunk") for n in (0, 1, 2)] == ["0 chunks", "1 chunk", "2 chunks"]
    assert plural(1, "probe") == "1 probe" and plural(3, "entry") == "3 entries"
    assert plural(2, "KV head") == "2 KV heads" and plural(2, "status", "statuses") == "2 statuses"
    assert [size(n) for n in (0, 512, 1536, 14 << 20, 3 << 30)] == [
        "0 B",
        "512 B",
        "1.5 KiB",
        "14.0 MiB",
        "3.0 GiB",
    ]
