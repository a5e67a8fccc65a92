"""A store held by another process: the error names the holder's PID and says what to do as a
command-line user; gc, migrate and fsck fail with one line, read-only commands keep working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from l3_helpers import header, payload_for

from kvtier.cli.l3 import command
from kvtier.tiers.l3 import L3Store, StoreInUse

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A store with one chunk, held for writing by a child process (like a running serve)."""
    root = tmp_path / "l3"
    with L3Store(root) as store:
        h = header(size=5000)
        store.put(h, payload_for(h.key, 5000))
    code = (
        "import sys\nfrom kvtier.tiers.l3 import L3Store\n"
        f"s = L3Store({str(root)!r})\nprint('ready', flush=True)\nsys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield root, child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


def test_open_names_the_holding_pid_and_a_cli_remedy(held: tuple[Path, int]) -> None:
    root, pid = held
    with pytest.raises(StoreInUse) as info:
        L3Store(root)
    message = str(info.value)
    assert info.value.pid == pid and f"process {pid}" in message
    assert "kvtier l3 fsck --check" in message and "read_only" not in message


@pytest.mark.parametrize(
    "args", [["gc"], ["migrate", "--older-than", "1s"], ["fsck"], ["fsck", "--rebuild"]]
)
def test_writing_commands_fail_in_one_line_while_held(
    held: tuple[Path, int], args: list[str]
) -> None:
    root, pid = held
    result = CliRunner().invoke(command, [*args, "--root", str(root)])
    assert result.exit_code == (8 if args[0] == "fsck" else 1)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert f"in use by process {pid}" in lines[0] and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_read_only_commands_keep_working_while_held(held: tuple[Path, int]) -> None:
    root, _ = held
    runner = CliRunner()
    result = runner.invoke(command, ["stat", "--root", str(root), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["chunks"] == 1
    result = runner.invoke(command, ["ls", "--root", str(root), "--json"])
    assert result.exit_code == 0 and len(json.loads(result.output)) == 1
    result = runner.invoke(command, ["fsck", "--check", "--root", str(root)])
    assert result.exit_code == 0, result.output


def test_the_lock_is_released_with_the_store(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    L3Store(root).close()
    with L3Store(root) as store:
        assert (root / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(StoreInUse, match="already open for writing in this process"):
            L3Store(root)
        assert store.stats().chunks == 0
