"""`kvtier replay --prefetch-ahead`: a returning turn's session is read into L2 before the turn is
due, so the turn restores from L2 where it would have read L3. A real server whose page pool and
L2 are small enough that the session's pages and chunks leave them before it returns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server_proc import ROOT, Server

# A (line 1) returns at 4 s (line 5) and shares its first two blocks (1,024 tokens); B, C and D
# in between take the pool's room (A's parked pages go) and L2's (A's chunks go, to L3 alone).
ROWS = [
    (0, 1400, [1, 2, 3]),
    (300, 1500, [10, 11, 12]),
    (600, 1500, [20, 21, 22]),
    (900, 1500, [30, 31, 32]),
    (4000, 1900, [1, 2, 5, 6]),
]
# the built-in model: 512 bytes a token, chunks of 256 tokens (128 KiB): a pool of 4,096 tokens,
# an L2 of 8 chunks
SIZES = ("--batch-kv-bytes", "2MiB", "--l2-bytes", "1MiB", "--max-concurrency", "2")


def _replay(url: str, trace: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "ops.cli", "replay", str(trace), "--url", url]
    cmd += ["--out", str(out), "--png", str(out.with_suffix(".png")), *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict = json.loads(out.read_text())
    result["stdout"] = done.stdout
    return result


def test_a_prefetched_session_restores_from_l2_where_it_would_read_l3(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": h})
            + "\n"
            for t, n, h in ROWS
        )
    )
    srv = Server(tmp_path / "l3", *SIZES).start()
    try:
        plain = _replay(srv.url, trace, tmp_path / "plain.json")
        ahead = _replay(srv.url, trace, tmp_path / "ahead.json", "--prefetch-ahead", "2")
    finally:
        assert srv.stop() == 0, srv.output()
    for result in (plain, ahead):
        assert result["replay"]["failed_turns"] == 0
        returning = result["samples"][-1]
        assert returning["line"] == 5 and returning["cached_tokens"] == 1024, returning
    assert plain["samples"][-1]["source"] == "l3"  # its pages and L2 copies went: read from L3
    assert plain["replay"]["prefetch"]["sent"] == 0 and plain["samples"][-1]["prefetch"] is None
    pf = ahead["replay"]["prefetch"]
    assert (pf["sent"], pf["ok"], pf["failed"]) == (1, 1, {}), pf  # the returning turn alone
    assert ahead["samples"][-1]["prefetch"] == "ok"
    assert ahead["samples"][-1]["source"] == "l2" and pf["restore_mix"] == {"l2": 1}
    assert "prefetched 2 s ahead: 1 of 1; those turns restored from: l2" in ahead["stdout"]
