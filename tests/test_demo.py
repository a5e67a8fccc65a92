"""`make demo` leaves nothing behind: scripts/demo.sh run for real (a short workload) with its
data dir under a temporary XDG_DATA_HOME. Each run starts with an empty L3 and keeps the newest
DEMO_KEEP_RUNS run directories; serve.pid goes when the server is stopped with kill -TERM; the
report names the doctor command for the demo's L3; `demo.sh clean` stops and deletes it all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh"), *args],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_demo_caps_its_l3_removes_its_pid_file_and_cleans_up(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "VENV": str(VENV),
        "DEMO_PORT": str(free_port()),
        "DEMO_SECONDS": "3",
        "DEMO_SESSIONS": "2",
        "DEMO_KEEP_RUNS": "3",
    }
    env.pop("DEMO_EXIT", None)
    data = tmp_path / "data" / "kvtier" / "demo"
    # What earlier runs left: an L3 with a session file, and five run directories.
    (data / "l3").mkdir(parents=True)
    (data / "l3" / "stale-chunk").write_bytes(b"x" * 4096)
    for i in range(5):
        (data / f"run-20200101-00000{i}").mkdir()
    pid = 0
    try:
        out = demo(env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "emptying the L3 of the previous run" in out.stdout
        # The summary reads in human units: the tiers from loadgen's report, no raw metric lines.
        assert "cache tiers after the run (from /metrics):" in out.stdout
        assert "kvtier_tier_used_bytes" not in out.stdout and "server-side" in out.stdout
        assert not (data / "l3" / "stale-chunk").exists()
        assert (data / "l3").is_dir()  # the server made a new one
        runs = sorted(p.name for p in data.glob("run-*"))
        assert len(runs) == 3 and runs[:2] == ["run-20200101-000003", "run-20200101-000004"]
        assert f"kvtier doctor --l3-root {data / 'l3'}" in out.stdout
        pid = int((data / "serve.pid").read_text())
        assert alive(pid)

        # A second demo while this one runs would share its L3: refused, nothing touched.
        again = demo({**env, "DEMO_PORT": str(free_port())})
        assert again.returncode == 1 and f"still runs (pid {pid})" in again.stderr
        assert alive(pid) and (data / "serve.pid").exists()

        os.kill(pid, signal.SIGTERM)  # as the report says to stop it
        deadline = time.monotonic() + 60
        while (data / "serve.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (data / "serve.pid").exists(), "serve.pid left behind after kill -TERM"
        assert not alive(pid)
    finally:
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
    clean = demo(env, "clean")
    assert clean.returncode == 0, clean.stderr
    assert not data.exists()
    assert demo(env, "clean").stdout.startswith("demo-clean: nothing to remove")
