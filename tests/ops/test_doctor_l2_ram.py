"""kvtier doctor's `l2.ram` check (issue 40: `kvtier doctor --l2-size 512GiB` on a 23 GiB host
gave no warning, and `kvtier serve` with that L2 then failed at start): the L2 size against the
host's memory, by L2's own rule, on the captured devvm tree (MemTotal 23.5 GiB, MemAvailable
22.6 GiB) with /proc/meminfo changed per scenario."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ops import doctor, tuning
from ops.cli import cli

DEVVM = Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "devvm"
GIB = tuning.GIB


def l2_ram(tmp_path: Path, l2: int | None, meminfo: dict[str, int] | None = None) -> doctor.Finding:
    """The l2.ram finding for an L2 of `l2` bytes; `meminfo` replaces lines (values in kB), and
    an empty dict leaves no meminfo at all."""
    root = tmp_path / "host"
    shutil.copytree(DEVVM, root, symlinks=True)
    path = root / "proc" / "meminfo"
    if meminfo == {}:
        path.unlink()
    elif meminfo:
        lines = [
            f"{k}:  {meminfo[k]} kB" if (k := ln.partition(":")[0]) in meminfo else ln
            for ln in path.read_text().splitlines()
        ]
        path.write_text("\n".join(lines) + "\n")
    facts = doctor.collect(
        l3_root=None, l2_bytes=l2, proc_root=str(root / "proc"), sys_root=str(root / "sys"),
        fs_root=str(root), memlock=-1,
    )  # fmt: skip
    return next(f for f in doctor.check(facts) if f.id == "l2.ram")


def test_an_l2_larger_than_the_hosts_memory_is_critical(tmp_path: Path) -> None:
    found = l2_ram(tmp_path, 512 * GIB)
    assert found.severity == "critical"
    assert found.observed == "MemTotal 23.5 GiB, MemAvailable 22.6 GiB"
    assert found.recommended == "MemAvailable >= 512.2 GiB (L2 512.0 GiB + headroom)"
    assert "--l2-bytes" in found.fix and "23.5 GiB" in found.fix and "BudgetError" in found.why
    assert doctor.exit_code([found]) == 2


def test_an_l2_past_the_memory_available_now_warns(tmp_path: Path) -> None:
    found = l2_ram(tmp_path, 8 * GIB, {"MemAvailable": 4 * 1024 * 1024})
    assert found.severity == "warning"
    assert "at most 3.8 GiB" in found.fix and "free host memory" in found.fix
    assert doctor.exit_code([found]) == 1


@pytest.mark.parametrize(
    ("l2", "meminfo", "severity"),
    [(2 * GIB, None, "ok"), (None, None, "info"), (2 * GIB, {}, "info")],
)
def test_an_l2_that_fits_or_an_unknown_is_not_a_fault(
    tmp_path: Path, l2: int | None, meminfo: dict[str, int] | None, severity: str
) -> None:
    found = l2_ram(tmp_path, l2, meminfo)
    assert found.severity == severity and found.why and found.fix
    if l2 is None:
        assert "--l2-" in found.fix  # says how to pass the size


def test_the_headroom_is_l2s_own() -> None:
    from kvtier.tiers.l2 import HEADROOM_BYTES

    assert tuning.L2_RAM_HEADROOM_BYTES == HEADROOM_BYTES


def test_the_command_fails_an_l2_no_host_has(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["doctor", "--json", "--l3-root", str(tmp_path), "--l2-size", "64TiB"]
    )
    found = {f["id"]: f for f in json.loads(result.stdout)["findings"]}
    assert found["l2.ram"]["severity"] == "critical"
    assert result.exit_code == 2
