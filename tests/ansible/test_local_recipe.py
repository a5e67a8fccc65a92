"""The local recipe of ansible/README.md, run as written: check mode on this machine writes
nothing and fails nothing; the converge, pointed at a scratch root, succeeds and a second run
changes nothing. Without systemd here, `kvtier_host_live=false` as the README says."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.skipif(
        not (BIN / "ansible-playbook").exists(),
        reason="ansible is not installed (pip install .[dev])",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the recipe's play uses become: run as root (or with -K by hand)"
    ),
]


def recipe() -> list[list[str]]:
    """The `ansible-playbook` commands of the README's local recipe, continuation lines joined."""
    text = (ANSIBLE / "README.md").read_text()
    section = text.split("## Local recipe", 1)[1]
    block = section.split("```", 2)[1]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [
        shlex.split(line) for line in joined.splitlines() if line.startswith("ansible-playbook")
    ]


def play(argv: list[str], home: Path, *extra: str) -> tuple[int, str, dict[str, int]]:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
    }
    proc = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, env=env, cwd=ANSIBLE, timeout=300
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"localhost\s+:\s+(.*)", out)
    recap = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))} if m else {}
    return proc.returncode, out, recap


def test_readme_local_recipe_checks_then_converges(tmp_path: Path) -> None:
    check, converge = recipe()
    assert "--check" in check and "--check" not in converge
    for argv in (check, converge):
        assert argv[:5] == ["ansible-playbook", "-i", "localhost,", "-c", "local"]
        assert any("ansible_python_interpreter" in a for a in argv)

    sysctl = Path("/etc/sysctl.d/90-kvtier.conf")
    existed = sysctl.exists()
    rc, out, recap = play(check, tmp_path, "-e", "kvtier_host_live=false")
    assert rc == 0 and recap.get("failed") == 0, out[-4000:]
    assert recap["changed"] > 0 or existed  # it reports what it would do ...
    assert sysctl.exists() == existed  # ... and writes nothing

    root = tmp_path / "root"
    root.mkdir()
    scratch = ["-e", "kvtier_host_live=false", "-e", f"kvtier_host_root={root}"]
    scratch += ["-e", "kvtier_host_user=root", "-e", "kvtier_host_group=root"]
    rc, out, first = play(converge, tmp_path, *scratch)
    assert rc == 0 and first["failed"] == 0 and first["changed"] > 0, out[-4000:]
    assert (root / "etc" / "sysctl.d" / "90-kvtier.conf").is_file()
    rc, out, second = play(converge, tmp_path, *scratch)
    assert rc == 0 and second["changed"] == 0, out[-4000:]
