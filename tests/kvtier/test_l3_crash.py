"""Crash safety: SIGKILL a writer at 200 random moments; nothing reported durable is lost or
corrupt, and fsck finds no corrupt chunk that anything references."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from l3_helpers import FP, payload_for

from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3.maint import fsck

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KILLS = 200


@pytest.mark.slow
def test_sigkill_writer_200_times(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    rng = random.Random(1234)
    durable: dict[str, int] = {}
    sessions: dict[str, list[str]] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    started = time.monotonic()
    for i in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "l3_crash_writer.py"), str(root), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "P":
                durable[parts[1]] = int(parts[2])
            elif len(parts) == 3 and parts[0] == "S":
                sessions[parts[1]] = parts[2].split(",")
    elapsed = time.monotonic() - started
    assert len(durable) > KILLS, f"writers reported only {len(durable)} puts in {elapsed:.0f}s"
    with L3Store(root) as store:
        report = fsck(store)
        assert report.quarantined == [] and report.left == [], report
        for key_hex, size in durable.items():
            key = bytes.fromhex(key_hex)
            header, data = store.get_bytes(key, fingerprint=FP)
            assert header.payload_len == size and data == payload_for(key, size)
        for sid, keys in sessions.items():
            rec = store.load_session(sid, "tenant")
            assert rec is not None and [k.hex() for k in rec.chunk_keys] == keys
        assert store.stats().checksum_failures == 0
    assert not list(root.rglob("*.tmp"))
