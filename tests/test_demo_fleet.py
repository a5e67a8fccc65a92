"""`make demo-fleet` (scripts/demo_fleet.sh): its arguments, a real two-host run, and that it stops
everything it started however it ends: at the end of the run, or on SIGTERM in the middle."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "demo_fleet.sh"
VENV = Path(sys.executable).parent.parent


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "KVTIER_"))}
    return out | {"VENV": str(VENV), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def fleet(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env()
    )


def has_l4() -> bool:
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "ops.cli", "serve", "--help"],
        capture_output=True, text=True, env=env(), timeout=60,
    )  # fmt: skip
    return "--l4-url" in out.stdout


def started_pids(output: str) -> list[int]:
    return [int(p) for p in re.findall(r"\(pid (\d+)", output)]


def gone(pids: list[int]) -> bool:
    """None of `pids` runs any more (a zombie waiting for its parent counts as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


@pytest.mark.parametrize(
    "args,message",
    [
        (["--turns", "1"], "--turns must be at least 2"),
        (["--seconds", "ten"], "--seconds needs a positive whole number, not 'ten'"),
        (["--sessions", "0"], "--sessions needs a positive whole number"),
        (["--sessions"], "--sessions needs a value"),
        (["--bogus"], "unknown argument '--bogus'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    out = fleet(*args)
    assert out.returncode == 2 and message in out.stderr
    assert "(pid" not in out.stdout


def test_help() -> None:
    out = fleet("--help")
    assert out.returncode == 0
    assert "scripts/demo_fleet.sh [--seconds N] [--sessions N]" in out.stdout
    assert "--no-l4" in out.stdout and "set -euo" not in out.stdout


@pytest.mark.skipif(has_l4(), reason="this kvtier serve has --l4-url: the full run is tested")
def test_without_an_l4_tier_it_says_so_and_starts_nothing() -> None:
    out = fleet("--seconds", "5")
    assert out.returncode == 1
    assert "this kvtier serve has no --l4-url (no L4 tier); run with --no-l4" in out.stderr
    assert "(pid" not in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_hosts_without_l4_report_each_host_and_stop(tmp_path: Path) -> None:
    run = tmp_path / "fleet"  # made by the script, so removed at the end but for the result
    out = fleet(
        "--no-l4", "--seconds", "6", "--sessions", "2", "--turns", "3", "--dir", str(run),
        timeout=500,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    pids = started_pids(out.stdout)
    assert len(pids) == 2 and gone(pids)  # the two servers, drained and stopped
    assert "per host (each session's turns went round the 2 hosts):" in out.stdout
    assert "hits by tier: " in out.stdout
    assert re.search(r"demo-fleet: \d+ turns landed on the other host", out.stdout)
    assert out.stdout.rstrip().endswith("demo-fleet: stopped everything it started")
    # The result path the report prints is still there; the logs and L3 roots are not.
    printed = re.search(r"^result: (\S+)  plot: (\S+)$", out.stdout, re.MULTILINE)
    assert printed and Path(printed.group(1)) == run / "loadgen.json"
    assert Path(printed.group(2)).is_file()
    result = json.loads(Path(printed.group(1)).read_text())
    assert len(result["hosts"]) == 2 and result["errors"] == {}
    assert sorted(p.name for p in run.iterdir()) == ["loadgen.json", "loadgen.png"]
    assert f"the result stays in {run}" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_mid_run_stops_everything_and_removes_its_directory() -> None:
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--no-l4", "--seconds", "300", "--sessions", "2", "--turns", "99"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
    )  # fmt: skip
    seen, children = [], []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 400
        for line in proc.stdout:
            seen.append(line)
            if "demo-fleet: loadgen:" in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        time.sleep(3)  # the fleet is running
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(children) >= 3, "".join(seen)  # two servers and the load generator
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 143, output
    assert "demo-fleet: stopped everything it started" in output
    assert gone(children), children
    made = re.search(r"L3 (\S+)/l3-a\)", output)
    assert made and not Path(made.group(1)).exists()  # its own temporary directory, removed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not has_l4(), reason="kvtier serve has no --l4-url yet (the L4 tier)")
def test_two_hosts_share_sessions_through_l4(tmp_path: Path) -> None:
    run = tmp_path / "fleet"
    out = fleet(
        "--seconds", "40", "--sessions", "3", "--turns", "4", "--dir", str(run), "--keep",
        timeout=800,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    pids = started_pids(out.stdout)
    assert len(pids) == 3 and gone(pids)  # Redis and the two servers
    assert re.search(r"hits by tier: .*l4 \d+", out.stdout), out.stdout
    result = json.loads((run / "loadgen.json").read_text())
    assert (run / "serve-a.log").exists() and (run / "l3-b").is_dir()  # --keep keeps it all
    moved = [s for s in result["samples"] if s["turn"] >= 1 and s["error"] is None]
    assert any(s["source"] == "l4" for s in moved), [s["source"] for s in moved]
