"""The cold root is part of the store's configuration: recorded in the index by migrate (or the
first open that names one), used by reads and maintenance, and a different one is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from l3_helpers import FP, header, payload_for

from kvtier.cache.config import CacheConfig
from kvtier.cli.l3 import command
from kvtier.errors import ChunkNotFound, StoreError
from kvtier.server.config import ServerConfig
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3.maint import fsck

SIZE = 9000


def fill(root: Path, n: int) -> list[tuple[bytes, bytes]]:
    out = []
    with L3Store(root) as store:
        for _ in range(n):
            h = header(size=SIZE)
            data = payload_for(h.key, SIZE)
            store.put(h, data)
            out.append((h.key, data))
        # idle for a day, so `migrate --older-than 1h` moves them
        with store.index.db:
            store.index.db.execute("UPDATE chunks SET last_access = ?", (time.time() - 86400,))
    return out


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(command, list(args))
    return result.exit_code, result.output


def test_migrate_to_a_cold_dir_then_reads_find_the_chunks(tmp_path: Path) -> None:
    root, cold = tmp_path / "l3", tmp_path / "slow-disk" / "cold"
    chunks = fill(root, 3)
    code, out = run(
        "migrate", "--root", str(root), "--cold-dir", str(cold), "--older-than", "1h", "--json"
    )
    assert code == 0 and json.loads(out)["chunks"] == 3
    assert len(list(cold.rglob("*.kvbin"))) == 3
    # The cache opens the store without being told where cold chunks are.
    for _ in range(2):  # and again after a reopen
        with L3Store(root) as store:
            assert store.dir("cold") == cold
            for key, data in chunks:
                assert store.index.get_chunk(key).tier == "cold"  # type: ignore[union-attr]
                assert store.get_bytes(key, fingerprint=FP)[1] == data
            assert store.stats().chunks == 3
    with L3Store(root, read_only=True) as store:
        assert store.get_bytes(chunks[0][0], fingerprint=FP)[1] == chunks[0][1]
    # Configured explicitly (the cache's CacheConfig.l3_cold_root), it opens as well.
    with L3Store(root, cold_dir=cold) as store:
        assert store.get_bytes(chunks[1][0], fingerprint=FP)[1] == chunks[1][1]
        assert fsck(store).exit_code == 0
    code, out = run("stat", "--root", str(root), "--json")
    assert code == 0 and json.loads(out)["cold_root"] == str(cold)


def test_another_cold_root_is_refused_then_adopted_explicitly(tmp_path: Path) -> None:
    root, cold, moved = tmp_path / "l3", tmp_path / "cold-a", tmp_path / "cold-b"
    chunks = fill(root, 2)
    assert (
        run("migrate", "--root", str(root), "--cold-dir", str(cold), "--older-than", "1h")[0] == 0
    )
    with pytest.raises(StoreError, match="keeps its cold chunks in") as info:
        L3Store(root, cold_dir=moved)
    assert "--adopt-cold-root" in str(info.value) and "--l3-cold-root" in str(info.value)
    code, out = run("gc", "--root", str(root), "--cold-dir", str(moved))
    assert code == 1 and "keeps its cold chunks in" in out and "Traceback" not in out
    # The operator moves the files and records the new place.
    cold.rename(moved)
    code, out = run(
        "fsck", "--root", str(root), "--cold-dir", str(moved), "--adopt-cold-root", "--json"
    )
    assert code == 0, out
    with L3Store(root) as store:
        assert store.dir("cold") == moved
        for key, data in chunks:
            assert store.get_bytes(key, fingerprint=FP)[1] == data


def test_the_default_cold_root_is_recorded_relative_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    chunks = fill(root, 1)
    code, out = run("migrate", "--root", str(root), "--older-than", "1h", "--json")
    assert code == 0 and json.loads(out)["chunks"] == 1
    with pytest.raises(StoreError, match="keeps its cold chunks in"):
        L3Store(root, cold_dir=tmp_path / "elsewhere")
    moved = tmp_path / "moved"
    root.rename(moved)  # the whole store moves: its cold chunks go with it
    with L3Store(moved) as store:
        assert store.dir("cold") == moved / "cold"
        assert store.get_bytes(chunks[0][0], fingerprint=FP)[1] == chunks[0][1]


def test_cold_root_setting_is_plumbed(tmp_path: Path) -> None:
    assert CacheConfig(l3_root=tmp_path, l3_cold_root=tmp_path / "c").l3_cold_root == tmp_path / "c"
    assert CacheConfig(l3_root=tmp_path).l3_cold_root is None
    assert ServerConfig.load(env={}).l3_cold_root is None
    cfg = ServerConfig.load(env={"KVTIER_L3_COLD_ROOT": "~/cold"})
    assert cfg.l3_cold_root == Path("~/cold").expanduser()
    assert ServerConfig.load({"l3_cold_root": "/x/cold"}, env={}).l3_cold_root == Path("/x/cold")
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[serve]\nl3_cold_root = "/srv/cold"\n')
    assert ServerConfig.load(env={}, file=toml).l3_cold_root == Path("/srv/cold")


def test_serve_has_the_cold_root_flag() -> None:
    import click

    from kvtier.server.run import options

    @click.command()
    @options
    def cmd(**kwargs: object) -> None:
        click.echo(repr(kwargs["l3_cold_root"]))

    result = CliRunner().invoke(cmd, ["--l3-cold-root", "/srv/cold"])
    assert result.exit_code == 0 and "/srv/cold" in result.output


def _forget_recorded_cold_root(root: Path) -> None:
    """Make the store look like one from before the cold root was recorded."""
    with L3Store(root) as store, store.index.db:
        store.index.db.execute("DELETE FROM meta")


def test_a_store_without_a_recorded_cold_root_loses_no_rows(tmp_path: Path) -> None:
    root, cold = tmp_path / "l3", tmp_path / "cold"
    chunks = fill(root, 2)
    assert (
        run("migrate", "--root", str(root), "--cold-dir", str(cold), "--older-than", "1h")[0] == 0
    )
    _forget_recorded_cold_root(root)
    with L3Store(root) as store:  # not told where the cold chunks went
        with pytest.raises(ChunkNotFound):
            store.get_bytes(chunks[0][0], fingerprint=FP)
        assert store.contains(chunks[0][0])  # the row is kept: the file may be elsewhere
    with L3Store(root, cold_dir=cold) as store:  # configured: found, and recorded
        for key, data in chunks:
            assert store.get_bytes(key, fingerprint=FP)[1] == data
    with L3Store(root) as store:
        assert store.dir("cold") == cold


def test_naming_a_new_cold_root_does_not_hide_chunks_already_cold(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    chunks = fill(root, 1)
    assert run("migrate", "--root", str(root), "--older-than", "1h")[0] == 0
    _forget_recorded_cold_root(root)
    with pytest.raises(StoreError, match="keeps its cold chunks in"):
        L3Store(root, cold_dir=tmp_path / "new")
    with L3Store(root) as store:
        assert store.get_bytes(chunks[0][0], fingerprint=FP)[1] == chunks[0][1]
