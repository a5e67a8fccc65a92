"""fsck converges: after it quarantined damaged chunks, a hibernated session's record is cut at
the first missing chunk, so the next run exits 0; and its exit codes are documented."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from click.testing import CliRunner
from l3_helpers import FP, header, payload_for

from kvtier.cli.l3 import command
from kvtier.tiers.l3 import L3Store, SessionRecord

C = 16  # tokens per chunk in these records


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(command, list(args))
    return result.exit_code, result.output


def hibernated(root: Path, n_chunks: int, tail: int) -> list[bytes]:
    """A session of n_chunks full chunks plus a tail chunk of `tail` tokens, saved in L3."""
    keys = []
    with L3Store(root) as store:
        for i in range(n_chunks + 1):
            tokens = C if i < n_chunks else tail
            h = header(size=5000, tokens=tokens)
            store.put(h, payload_for(h.key, 5000))
            keys.append(h.key)
        ids = array("i", range(n_chunks * C + tail)).tobytes()
        store.save_session(
            SessionRecord("conv-1", "acme", FP, ids, tuple(keys), False, None, 1.0, "hibernated")
        )
    return keys


def damage(root: Path, key: bytes) -> None:
    path = root / "hot" / key.hex()[:2] / f"{key.hex()}.kvbin"
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\x00\xff\x00")


def test_fsck_cuts_the_session_at_the_first_missing_chunk_and_converges(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    keys = hibernated(root, n_chunks=4, tail=5)
    damage(root, keys[2])
    damage(root, keys[4])  # the tail, after the first damaged one
    code, out = run("fsck", "--root", str(root), "--check", "--json")
    left = json.loads(out)["left"]
    assert code == 4 and any("references missing chunk" not in x for x in left)  # problems left
    code, out = run("fsck", "--root", str(root), "--json")
    report = json.loads(out)
    assert code == 1, out
    assert len(report["quarantined"]) == 2 and len(report["sessions_truncated"]) == 1
    assert "keeps its first 2 of 5 chunks (32 tokens)" in report["sessions_truncated"][0]
    with L3Store(root, read_only=True) as store:
        rec = store.load_session("conv-1", "acme")
        assert rec is not None
        assert rec.chunk_keys == tuple(keys[:2])
        assert list(array("i", rec.token_ids)) == list(range(2 * C))
        assert (rec.state, rec.last_active) == ("hibernated", 1.0)
    code, out = run("fsck", "--root", str(root))
    assert code == 0, out
    assert run("fsck", "--root", str(root), "--check")[0] == 0


def test_fsck_keeps_full_chunks_when_only_the_tail_is_missing(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    keys = hibernated(root, n_chunks=2, tail=7)
    with L3Store(root) as store:
        store.path(keys[2]).unlink()
    code, out = run("fsck", "--root", str(root), "--json")
    assert code == 1 and json.loads(out)["stale_rows"] == 1
    with L3Store(root, read_only=True) as store:
        rec = store.load_session("conv-1", "acme")
        assert rec is not None and rec.chunk_keys == tuple(keys[:2])
        assert len(rec.token_ids) == 4 * 2 * C
    assert run("fsck", "--root", str(root))[0] == 0


def test_fsck_help_and_usage_exit_codes(tmp_path: Path) -> None:
    code, out = run("fsck", "--help")
    assert code == 0
    for line in (
        "0  clean",
        "1  problems found and all repaired",
        "2  usage error",
        "4  problems left",
        "8  ",
    ):
        assert line in out
    assert "16" not in out
    # click's usage error, as every command; "problems left" is 4, as fsck(8)'s
    assert run("fsck", "--no-such-flag")[0] == 2
    code, out = run("fsck", "--root", str(tmp_path / "missing"), "--check")
    assert code == 8 and "does not exist" in out
