"""Under write-through a committed chunk reaches L3 within `l3_write_bound_s`, even when its
write was shed by a full queue and nothing calls the cache after: a crash past the bound leaves
no session record naming a chunk that L3 lacks (`kvtier l3 fsck --check` is clean)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from kvtier.cli import cli

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BOUND_S = 0.5


def test_a_crash_past_the_bound_leaves_every_committed_chunk_in_l3(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "cache_crash_proc.py"), str(root), "16", str(BOUND_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # every turn committed, most L3 writes shed
        assert line.strip() == "committed", proc.communicate(timeout=60)[1][-3000:]
        time.sleep(BOUND_S + 3.0)  # idle past the bound: no call reaches the cache
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    result = CliRunner().invoke(cli, ["l3", "fsck", "--check", "--root", str(root)])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith("clean"), result.output
    assert "sessions cut    0" in result.output
